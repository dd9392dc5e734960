"""Node KV pool actors: one per Ray node that runs engines.

Each owns its node's host KV pool: with offload on, the memory itself (one
shared-memory file, tokenflow/kv_offload/host_shm.py, committed when the actor starts)
and which engine holds which slot of it; always, the accounting (each
engine's quota, an equal share) and the usage and transfer counters engines
report:

    acquire_slot(engine_id, pid) -> host_shm.Region as a dict (before the
                                    engine starts; a restarted engine reuses
                                    the slot its predecessor left)
    register_engine(engine_id) -> quota_bytes
    report(engine_id, counters) -> quota_bytes   (quotas shrink as engines join)
    unregister_engine(engine_id)
    stats() -> dict

The app builder creates one per alive node that can host an engine; an
engine also asks for its own node's pool when it starts (a node added
later). Both use a detached actor named after the node id and a digest of
the kv_pool settings, with get_if_exists, pinned to the node: one per node
and settings. A pool lives as long as engines use it: once no engine has
held a slot or reported for `idle_exit_s`, it removes itself and its memory
is freed (after `serve delete`; and a redeploy with other kv_pool settings
gets a pool of its own while the old one drains). Detached, so that it
outlives any one engine replica: a restarted engine takes over the slot its
predecessor left. If the actor itself restarts, it commits a new file;
engines already running keep the old one (freed when they exit), so for
that while the node holds more than its pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import ray
from pydantic import Field

from tokenflow.core.settings import Amount, Count, Positive, Settings
from tokenflow.kv_offload import host_shm
from tokenflow.serve.idle import exit_when_idle

NAMESPACE = "tokenflow"
NAME_PREFIX = "tokenflow-kv-pool:"
logger = logging.getLogger("ray")


class KVPoolSettings(Settings):
    """The `kv_pool:` block of the app args (configs/*.yaml)."""

    block = "kv_pool"

    enabled: bool = Field(True, description="Start one host KV pool actor per node.")
    offload: bool = Field(False, description="Give each engine a host KV tier (tokenflow/kv_offload/, on vLLM's "
                                             "OffloadingConnector) of its share of the pool: pauses then reload "
                                             "instead of recompute.")
    size_bytes: Amount | None = Field(None, description="Host KV pool per node in bytes; null: ram_fraction of the "
                                                        "node's RAM.")
    ram_fraction: float = Field(0.2, gt=0, lt=1, description="Share of the node's RAM (or of the container's "
                                                             "memory limit, if lower) for the pool when "
                                                             "size_bytes is null.")
    engines_per_node: Count = Field(1, description="Engines a node runs at most (GPUs per node; replicas on a CPU "
                                                   "box): each engine's tier is fixed at size / engines_per_node, "
                                                   "so a node's engines never hold more than its pool.")
    shared_memory: bool = Field(True, description="The pool is one shared-memory file the node's actor commits at "
                                                  "start and engines map their slot of; false: each engine "
                                                  "allocates its own share (same size, no sharing, no reuse).")
    shm_dir: str = Field("/dev/shm", description="A tmpfs with room for size_bytes.")
    report_interval_s: Positive = Field(1.0, description="How often (s) engines report their counters to the pool.")
    engine_ttl_s: Positive = Field(30.0, description="An engine silent this long (s) gives its share back.")
    idle_exit_s: Positive = Field(60.0, description="A pool no engine has used (held a slot or reported) for this "
                                                    "long (s) removes itself and frees its memory.")

    def node_bytes(self) -> int:
        return self.size_bytes if self.size_bytes is not None else int(node_ram_bytes() * self.ram_fraction)

    def engine_bytes(self) -> int:
        """One engine's fixed share: the size of its host KV tier."""
        return self.node_bytes() // self.engines_per_node


class PoolAccounting:
    """Quotas and counters of one node's pool (pure; the actor wraps it)."""

    def __init__(self, total_bytes: int, engine_ttl_s: float = 30.0, clock=time.monotonic,
                 engines_per_node: int = 1):
        self.total_bytes = int(total_bytes)
        self.engines_per_node = engines_per_node
        self.engine_ttl_s = engine_ttl_s
        self.clock = clock
        self.engines: dict[str, dict] = {}  # id -> {"counters": {...}, "seen": t}

    def _expire(self) -> None:
        now = self.clock()
        for eid in [e for e, v in self.engines.items() if now - v["seen"] > self.engine_ttl_s]:
            del self.engines[eid]

    def quota(self, engine_id: str) -> int:
        if engine_id not in self.engines:
            return 0
        # Shares are fixed by engines_per_node (an engine sizes its tier once,
        # at start); more engines than that split the pool further.
        return self.total_bytes // max(len(self.engines), self.engines_per_node)

    def register(self, engine_id: str) -> int:
        self._expire()
        entry = self.engines.setdefault(engine_id, {"counters": {}, "seen": 0.0})
        entry["seen"] = self.clock()
        return self.quota(engine_id)

    def unregister(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)

    def engine_ids(self) -> list[str]:
        """Engines registered and not silent past the TTL."""
        self._expire()
        return sorted(self.engines)

    def report(self, engine_id: str, counters: dict) -> int:
        self.register(engine_id)  # a report also proves the engine is alive
        self.engines[engine_id]["counters"] = dict(counters or {})
        return self.quota(engine_id)

    def stats(self) -> dict:
        self._expire()
        totals: dict[str, float] = {}
        for v in self.engines.values():
            for k, x in v["counters"].items():
                if isinstance(x, (int, float)):
                    totals[k] = totals.get(k, 0) + x
        return {"total_bytes": self.total_bytes,
                "engines": {e: {"quota_bytes": self.quota(e), "counters": v["counters"]}
                            for e, v in sorted(self.engines.items())},
                "totals": totals}


class PoolFull(RuntimeError):
    pass


@dataclass
class SlotHolder:
    engine_id: str
    pid: int  # 0 once the engine said goodbye (its workers may still map it)


class SlotTable:
    """Which engine holds which slot of the node's pool file (pure; `held`
    tells whether a holder still uses its slot: pid alive or mapped)."""

    def __init__(self, slots: int, held):
        self.holders: list[SlotHolder | None] = [None] * slots
        self.held = held  # (slot, SlotHolder) -> bool
        self.reused = 0  # slots handed on from a gone engine

    def acquire(self, engine_id: str, pid: int) -> int:
        for i, h in enumerate(self.holders):
            if h is not None and h.engine_id == engine_id:
                h.pid = pid
                return i
        free = [i for i, h in enumerate(self.holders) if h is None]
        if not free:
            free = [i for i, h in enumerate(self.holders) if not self.held(i, h)]
            self.reused += bool(free)
        if not free:
            raise PoolFull(f"all {len(self.holders)} host KV slots of this node are held by live engines "
                           f"({', '.join(h.engine_id for h in self.holders)}); "
                           "raise kv_pool.engines_per_node to run more engines per node")
        self.holders[free[0]] = SlotHolder(engine_id, pid)
        return free[0]

    def release(self, engine_id: str) -> None:
        for h in self.holders:
            if h is not None and h.engine_id == engine_id:
                h.pid = 0

    def as_list(self) -> list[dict | None]:
        return [None if h is None else {"engine_id": h.engine_id, "pid": h.pid} for h in self.holders]


# Where a container's memory limit shows (cgroup v2, then v1).
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def node_ram_bytes(limit_files=CGROUP_LIMIT_FILES) -> int:
    """The memory this node's processes may use: the host's RAM, or the
    container's memory limit where that is lower (a pool sized from host
    RAM inside a smaller container gets the engines OOM-killed)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limit_files:
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            return min(ram, int(raw))
    return ram


@ray.remote(num_cpus=0, max_restarts=-1)
class KVPoolActor:
    def __init__(self, node_id: str, settings: dict | None = None):
        s = KVPoolSettings.from_dict(settings)
        self.node_id = node_id
        self.running_on = ray.get_runtime_context().get_node_id()
        total = s.node_bytes()
        self.file = self.slots = None
        if s.offload and s.shared_memory:
            self.slot_bytes = host_shm.slot_bytes(total, s.engines_per_node)
            total = self.slot_bytes * s.engines_per_node
            self.file = host_shm.PoolFile(s.shm_dir, f"{node_id[:12]}-{os.getpid()}", total)
            self.slots = SlotTable(s.engines_per_node, self._held)
        self.pool = PoolAccounting(total, s.engine_ttl_s, engines_per_node=s.engines_per_node)
        self.idle_exit_s = s.idle_exit_s
        self._used_at = time.monotonic()
        exit_when_idle(min(5.0, self.idle_exit_s / 4))

    def in_use(self) -> bool:
        """An engine holds a slot (its process lives, or maps its bytes) or reports."""
        if self.pool.engine_ids():
            return True
        return self.slots is not None and any(
            h is not None and self._held(i, h) for i, h in enumerate(self.slots.holders))

    def exit_if_idle(self) -> None:
        now = time.monotonic()
        if self.in_use():
            self._used_at = now
        elif now - self._used_at >= self.idle_exit_s:
            logger.info(f"TokenFlow KV pool of node {self.node_id}: unused for {self.idle_exit_s:g} s; removing it")
            ray.actor.exit_actor()  # an intended exit: not restarted

    def _held(self, slot: int, h: SlotHolder) -> bool:
        if host_shm.pid_alive(h.pid):
            return True
        r = self.file.region(slot, self.slot_bytes)
        lo, hi = r.offset, r.offset + r.nbytes
        ranges = host_shm.mapped_ranges(self.file.inode)
        return any(start < hi and end > lo for rs in ranges.values() for start, end in rs)

    def acquire_slot(self, engine_id: str, pid: int) -> dict:
        """The engine's slot of the node's pool memory, to map before it starts."""
        if self.file is None:
            raise ValueError("this node's KV pool has no shared memory (kv_pool.offload or shared_memory is off)")
        slot = self.slots.acquire(engine_id, pid)
        self.pool.register(engine_id)
        return self.file.region(slot, self.slot_bytes).to_dict()

    def register_engine(self, engine_id: str) -> int:
        return self.pool.register(engine_id)

    def unregister_engine(self, engine_id: str) -> None:
        self.pool.unregister(engine_id)
        if self.slots is not None:
            self.slots.release(engine_id)

    @ray.method(enable_task_events=False)  # periodic: no GCS task record each time
    def report(self, engine_id: str, counters: dict) -> int:
        return self.pool.report(engine_id, counters)

    def stats(self) -> dict:
        out = {"node_id": self.node_id, "running_on": self.running_on, **self.pool.stats()}
        if self.file is not None:
            out["shared_memory"] = {"bytes": self.file.nbytes, "slot_bytes": self.slot_bytes,
                                    "inode": self.file.inode, "pid": os.getpid(),
                                    "slots": self.slots.as_list(), "slots_reused": self.slots.reused}
        return out


def pool_name(node_id: str, settings: KVPoolSettings) -> str:
    return f"{NAME_PREFIX}{node_id}:{settings.fingerprint()}"


def get_node_pool(node_id: str, settings: KVPoolSettings | dict | None = None):
    """Handle to the pool of `node_id` for these settings, created there on first use."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not isinstance(settings, KVPoolSettings):
        settings = KVPoolSettings.from_dict(settings)
    return KVPoolActor.options(
        name=pool_name(node_id, settings), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(node_id, settings.to_dict())


def engine_nodes(required: dict[str, float]) -> list[str]:
    """Alive nodes whose total resources can hold one engine's first bundle."""
    out = []
    for node in ray.nodes():
        res = node.get("Resources") or {}
        if node.get("Alive") and all(res.get(k, 0) >= v for k, v in required.items() if v > 0):
            out.append(node["NodeID"])
    return out


def ensure_node_pools(settings: KVPoolSettings, required: dict[str, float]) -> dict[str, object]:
    """One pool per alive node that can run an engine; existing ones are reused."""
    return {nid: get_node_pool(nid, settings) for nid in engine_nodes(required)}


def list_pools() -> dict[str, str]:
    """Pool actor name -> its node id, for every pool (alive or restarting)."""
    from ray.util import list_named_actors

    names = list_named_actors(all_namespaces=True)
    return {a["name"]: a["name"][len(NAME_PREFIX):].split(":")[0] for a in names
            if a.get("namespace") == NAMESPACE and a["name"].startswith(NAME_PREFIX)}


async def pool_stats(timeout: float = 5.0) -> dict[str, dict]:
    """stats() of every pool, by actor name (for /v1/tokenflow/engines)."""
    out = {}
    for name in await asyncio.to_thread(list_pools):  # GCS look-ups: off the event loop
        try:
            handle = await asyncio.to_thread(ray.get_actor, name, namespace=NAMESPACE)
            out[name] = await asyncio.wait_for(handle.stats.remote(), timeout)
        except Exception as e:
            out[name] = {"error": repr(e)}
    return out


def kill_node_pools() -> int:
    n = 0
    for name in list_pools():
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            n += 1
        except ValueError:
            pass
    return n
