"""Cluster-wide pieces of TokenFlow that live outside a single engine.

- ranking.py       pure: engine state, slack, ranking, the ingress's routing table
- engine_state.py  pure: an engine's own streams (ReaderBuffer per request)
- engine_agent.py  engine side: pushes state, registers with the node KV pool
- router.py        the global router actor (one per app)
- kv_pool.py       node KV pool actors (one per node that runs engines)
"""
