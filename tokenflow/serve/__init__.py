"""The Ray Serve side: the app builder and its settings, the OpenAI ingress
and its guard, the engine replica, the node KV pool actor, metrics, and the
slack routing (routing/)."""
