"""Scheduler side of the host KV pool: which block lives in which host row.

vLLM's OffloadingConnector asks this manager, by block hash ("key"), whether a
block is in host memory, where to write a new one, and where to read one
back. The manager never touches tensors; the worker (worker.py) does the
copies and the connector reports when they finish.

Eviction, when the pool is full, takes the least recently used block that no
transfer is reading or writing, in two tiers: first blocks no live request
relies on (finished or aborted requests), then live ones. A request whose
blocks were evicted is simply recomputed by vLLM: lookups stop at the first
missing block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource


class HostBlocks(BlockIDsLoadStoreSpec):
    """Rows of the host pool (one row = one offloaded block or chunk)."""


@dataclass
class TransferMeter:
    """Bytes and seconds of recent transfers, decayed so the speed follows
    the current load (the bus is shared with whatever else runs)."""

    decay: float = 0.9
    bytes: float = 0.0
    seconds: float = 0.0
    total_bytes: int = 0  # undecayed, since start
    total_seconds: float = 0.0

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.bytes = self.decay * self.bytes + nbytes
        self.seconds = self.decay * self.seconds + seconds
        self.total_bytes += int(nbytes)
        self.total_seconds += seconds

    def bytes_per_s(self) -> float | None:
        return self.bytes / self.seconds if self.seconds > 0 else None


@dataclass
class OffloadCounters:
    """What the pool did since start. Bytes count all workers together.
    Lookups count every probe: a request that waits for memory is probed
    again on each step it is considered."""

    bytes_per_block: int  # one host row, all workers
    bytes_per_token: float  # one worker, for converting measured speed
    capacity_blocks: int
    blocks_stored: int = 0
    blocks_loaded: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    evictions: int = 0
    evicted_live: int = 0  # evicted while a live request relied on it
    stores_rejected: int = 0  # every row was busy in a transfer: the store is retried
    blocks_dropped: int = 0  # did not fit even after eviction: never stored
    load: TransferMeter = field(default_factory=TransferMeter)
    store: TransferMeter = field(default_factory=TransferMeter)

    @property
    def bytes_stored(self) -> int:
        return self.blocks_stored * self.bytes_per_block

    @property
    def bytes_loaded(self) -> int:
        return self.blocks_loaded * self.bytes_per_block

    def _tps(self, bps: float | None) -> float | None:
        return bps / self.bytes_per_token if bps and self.bytes_per_token else None

    @property
    def load_tps(self) -> float | None:
        return self._tps(self.load.bytes_per_s())

    @property
    def store_tps(self) -> float | None:
        return self._tps(self.store.bytes_per_s())

    @property
    def transfer_tps(self) -> float | None:
        """Host<->device KV tokens/s, both directions pooled (same bus);
        None until a transfer has been measured."""
        pooled = TransferMeter(bytes=self.load.bytes + self.store.bytes,
                               seconds=self.load.seconds + self.store.seconds)
        return self._tps(pooled.bytes_per_s())

    def as_dict(self) -> dict:
        names = ("capacity_blocks", "blocks_stored", "bytes_stored", "blocks_loaded", "bytes_loaded",
                 "lookup_hits", "lookup_misses", "evictions", "evicted_live", "stores_rejected", "blocks_dropped",
                 "load_tps", "store_tps", "transfer_tps")
        return {n: getattr(self, n) for n in names}


@dataclass
class _Slot:
    row: int
    ready: bool = False  # False while its store is in flight
    pins: int = 0  # in-flight loads reading it

    @property
    def busy(self) -> bool:
        return not self.ready or self.pins > 0


class HostPoolManager(OffloadingManager):
    def __init__(self, num_blocks: int, bytes_per_block: int, bytes_per_token: float,
                 enable_events: bool = False, engine_blocks_per_block: int = 1):
        self.num_blocks = num_blocks  # host rows; each holds engine_blocks_per_block engine blocks
        self.engine_blocks_per_block = engine_blocks_per_block
        self.counters = OffloadCounters(bytes_per_block, bytes_per_token, num_blocks)
        self._free_rows = list(range(num_blocks - 1, -1, -1))  # pop() gives row 0 first
        # Every stored key is in exactly one tier, least recent first.
        self._idle: OrderedDict[OffloadKey, _Slot] = OrderedDict()  # no live request
        self._live: OrderedDict[OffloadKey, _Slot] = OrderedDict()
        self._owners: dict[OffloadKey, int] = {}  # live requests relying on a key
        self._chains: dict[str, dict[OffloadKey, None]] = {}  # req_id -> its keys, in order
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    # --- bookkeeping ------------------------------------------------------
    def _slot(self, key: OffloadKey) -> _Slot | None:
        return self._live.get(key) or self._idle.get(key)

    def _tier(self, key: OffloadKey) -> OrderedDict[OffloadKey, _Slot]:
        return self._live if key in self._owners else self._idle

    def _touch(self, keys: Iterable[OffloadKey]) -> None:
        # Reversed, so a request's first block ends up the most recent: the
        # pool then trims a request from its tail, and what stays is still a
        # loadable prefix.
        for key in reversed(list(keys)):
            tier = self._tier(key)
            if key in tier:
                tier.move_to_end(key)

    def _own(self, req_id: str, keys: Iterable[OffloadKey]) -> None:
        chain = self._chains.setdefault(req_id, {})
        for key in keys:
            if key in chain:
                continue
            chain[key] = None
            self._owners[key] = self._owners.get(key, 0) + 1
            if key in self._idle:
                self._live[key] = self._idle.pop(key)

    def _disown(self, req_id: str) -> None:
        # Tail first into the idle tier, so its prefix is evicted last.
        for key in reversed(list(self._chains.pop(req_id, {}))):
            left = self._owners[key] - 1
            if left:
                self._owners[key] = left
                continue
            del self._owners[key]
            if key in self._live:
                self._idle[key] = self._live.pop(key)

    def _evict(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey]:
        """Free up to n rows, least recently used idle blocks first."""
        victims = []
        for tier in (self._idle, self._live):
            for key, slot in tier.items():
                if len(victims) == n:
                    break
                if not slot.busy and key not in protected:
                    victims.append((tier, key))
        for tier, key in victims:
            self._free_rows.append(tier.pop(key).row)
            self.counters.evictions += 1
            self.counters.evicted_live += tier is self._live
        keys = [key for _, key in victims]
        self._emit(keys, removed=True)
        return keys

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed))

    def pinned_blocks(self, keys: Iterable[OffloadKey] | None = None) -> int:
        """Blocks (all, or of `keys`) an in-flight transfer holds; 0 once the
        engine has drained."""
        slots = (self._slot(k) for k in keys) if keys is not None else \
            (s for tier in (self._idle, self._live) for s in tier.values())
        return sum(s.busy for s in slots if s is not None)

    def tier_of(self, key: OffloadKey) -> str | None:
        """"live" (a live request relies on it), "idle", or None (not stored)."""
        return "live" if key in self._live else "idle" if key in self._idle else None

    def live_blocks(self) -> int:
        return len(self._live)

    def stored_blocks(self) -> int:
        return len(self._live) + len(self._idle)

    def keys_of(self, req_id: str) -> list[OffloadKey]:
        return list(self._chains.get(req_id, ()))

    def host_blocks_of(self, req_id: str) -> int:
        """How many of a live request's engine blocks a resume could load:
        the stored prefix of its chain (a lookup stops at the first gap)."""
        n = 0
        for key in self._chains.get(req_id, ()):
            slot = self._slot(key)
            if slot is None or not slot.ready:
                break
            n += 1
        return n * self.engine_blocks_per_block

    # --- OffloadingManager --------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        slot = self._slot(key)
        if slot is None:
            self.counters.lookup_misses += 1
            return LookupResult.MISS
        self.counters.lookup_hits += 1
        return LookupResult.HIT if slot.ready else LookupResult.HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostBlocks:
        rows = []
        for key in keys:
            slot = self._slot(key)
            assert slot is not None and slot.ready, "the connector loads only looked-up hits"
            slot.pins += 1
            rows.append(slot.row)
        self._own(req_context.req_id, keys)
        self._touch(keys)
        return HostBlocks(rows)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            slot = self._slot(key)
            if slot is not None and slot.pins > 0:
                slot.pins -= 1
        self.counters.blocks_loaded += len(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        new = [k for k in keys if self._slot(k) is None]
        evicted: list[OffloadKey] = []
        shortfall = len(new) - len(self._free_rows)
        if shortfall > 0:
            # Never evict what this very store offers: those blocks must stay.
            evicted = self._evict(shortfall, protected=set(keys))
            if not self._free_rows:
                self.counters.stores_rejected += 1
                return None  # every row is busy in a transfer: the connector retries next step
            # Store the prefix that fits (a lookup stops at the first gap
            # anyway); the connector will not offer the rest again.
            self.counters.blocks_dropped += max(0, len(new) - len(self._free_rows))
            dropped = set(new[len(self._free_rows):])
            new = new[:len(self._free_rows)]
            keys = [k for k in keys if k not in dropped]
        self._own(req_context.req_id, keys)  # before inserting: it picks the tier
        rows = []
        for key in new:
            slot = _Slot(self._free_rows.pop())
            self._tier(key)[key] = slot
            rows.append(slot.row)
        return PrepareStoreOutput(keys_to_store=new, store_spec=HostBlocks(rows), evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        done = []
        for key in keys:
            slot = self._slot(key)
            if slot is None or slot.ready:
                continue
            if success:
                slot.ready = True
                done.append(key)
            else:
                self._free_rows.append(self._tier(key).pop(key).row)
        self.counters.blocks_stored += len(done)
        self._emit(done, removed=False)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # A paused (preempted) request's host copy is now its only copy.
        for req_id in context.preempted_req_ids:
            self._touch(self._chains.get(req_id, ()))

    def on_request_finished(self, req_context: ReqContext) -> None:
        # Its blocks stay (another request may share the prefix) but drop
        # to the first eviction tier unless a live request still uses them.
        self._disown(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def reset_cache(self) -> None:
        # The connector guarantees no completion arrives for older jobs.
        self._idle.clear()
        self._live.clear()
        self._free_rows = list(range(self.num_blocks - 1, -1, -1))
        # Live requests start new chains with whatever they store next.
        self._chains = {req_id: {} for req_id in self._chains}
        self._owners.clear()

    # --- measured speed (fed by connector.TokenFlowOffloadingConnector) -----
    def record_transfer(self, load_bytes: int, load_seconds: float, store_bytes: int, store_seconds: float) -> None:
        self.counters.load.add(load_bytes, load_seconds)
        self.counters.store.add(store_bytes, store_seconds)
