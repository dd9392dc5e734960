"""The node's shared host KV pool (tokenflow/kv_offload/host_shm.py) and its slot table
(tokenflow/serve/kv_pool.py SlotTable), with real processes: the pool's owner, and
engines that map their slot in other processes."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os

import pytest

from tokenflow.kv_offload import host_shm
from tokenflow.serve.kv_pool import PoolFull, SlotHolder, SlotTable

SLOT = 4 * host_shm.PAGE


def _engine(region: dict, fill: int, ready, go) -> None:
    """What an engine's worker does: map its slot, write its KV rows."""
    t = host_shm.map_region(host_shm.Region(**region))
    t.fill_(fill)
    ready.set()
    go.wait(30)  # keep the mapping until the test has looked


@pytest.fixture
def pool_file():
    f = host_shm.PoolFile("/dev/shm", f"test-{os.getpid()}", 2 * SLOT)
    yield f
    f.close()


def _spawn(f, slot: int, fill: int):
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_engine, args=(f.region(slot, SLOT).to_dict(), fill, ready, go))
    p.start()
    assert ready.wait(180), "the engine process never mapped its slot"
    return p, go


def test_engines_write_their_own_slot_of_one_unlinked_file(pool_file):
    f = pool_file
    # Unlinked at once: nothing is left in /dev/shm, whatever happens later.
    assert not any(n.startswith(host_shm.PREFIX + f"test-{os.getpid()}") for n in os.listdir("/dev/shm"))
    a, go_a = _spawn(f, 0, 7)
    b, go_b = _spawn(f, 1, 9)
    try:
        view = mmap.mmap(f.fd, f.nbytes)
        assert view[:SLOT] == bytes([7]) * SLOT and view[SLOT:] == bytes([9]) * SLOT
        # The owner sees who maps which bytes (how it tells a slot is held).
        ranges = host_shm.mapped_ranges(f.inode)
        assert ranges[a.pid] == [(0, SLOT)] and ranges[b.pid] == [(SLOT, 2 * SLOT)]
        assert host_shm.pid_alive(a.pid)
    finally:
        go_a.set(), go_b.set()
        a.join(30), b.join(30)
    assert not host_shm.pid_alive(a.pid)
    assert a.pid not in host_shm.mapped_ranges(f.inode)


def test_a_workers_part_of_a_slot_maps_at_any_offset(pool_file):
    """A tensor-parallel engine's workers split its slot; a part need not
    start on a page (mmap's unit)."""
    part = pool_file.region(1, SLOT).part(1, SLOT // 2 - 100)
    assert part.offset % host_shm.PAGE
    t = host_shm.map_region(part)
    t.fill_(5)
    view = mmap.mmap(pool_file.fd, pool_file.nbytes)
    assert view[part.offset - 1] == 0 and view[part.offset:part.offset + part.nbytes] == bytes([5]) * part.nbytes
    assert view[part.offset + part.nbytes] == 0


def test_a_pool_larger_than_the_tmpfs_fails_at_start_with_a_clear_error():
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises(OSError, match="cannot commit .* host KV pool .* kv_pool.size_bytes"):
        host_shm.PoolFile("/dev/shm", f"too-big-{os.getpid()}", too_big)
    assert not any(n.startswith(host_shm.PREFIX + "too-big") for n in os.listdir("/dev/shm"))


def test_region_parts_are_per_worker_and_checked():
    r = host_shm.Region("/x", 8192, 4096, 1, 5)
    assert r.part(1, 2048) == host_shm.Region("/x", 10240, 2048, 1, 5)
    with pytest.raises(ValueError, match="slot has 4096"):
        r.part(2, 2048)


def test_slot_table_reuses_only_slots_whose_holder_is_gone():
    in_use = {0: True, 1: True}
    t = SlotTable(2, held=lambda slot, h: in_use[slot])
    assert t.acquire("e1", 11) == 0 and t.acquire("e2", 12) == 1
    assert t.acquire("e1", 13) == 0  # the same engine asking again keeps its slot
    with pytest.raises(PoolFull, match=r"all 2 host KV slots .*\(e1, e2\).*engines_per_node"):
        t.acquire("e3", 14)
    in_use[1] = False  # e2's process died and nothing maps its slot any more
    assert t.acquire("e3", 14) == 1 and t.reused == 1
    in_use[1] = True
    t.release("e1")  # a goodbye keeps the slot held while something maps it
    assert t.holders[0] == SlotHolder("e1", 0)
    with pytest.raises(PoolFull):
        t.acquire("e4", 15)


def test_pool_default_size_stays_within_a_containers_memory_limit(tmp_path):
    """kv_pool.size_bytes null: ram_fraction of the node's memory, which
    inside a container is its memory limit where that is lower than RAM."""
    from tokenflow.serve.kv_pool import node_ram_bytes

    ram = node_ram_bytes(limit_files=())
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")  # cgroup v2 without a limit
    v1.write_text(f"{2**30}\n")
    assert node_ram_bytes(limit_files=(str(v2),)) == ram
    assert node_ram_bytes(limit_files=(str(tmp_path / "absent"), str(v1))) == min(ram, 2**30)
    v2.write_text(f"{ram * 4}\n")  # a limit above RAM: RAM bounds it
    assert node_ram_bytes(limit_files=(str(v2),)) == ram


POOL_LIFE = r'''
import json, subprocess, time
import ray
from tokenflow.serve import kv_pool

ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
node = ray.get_runtime_context().get_node_id()
small = kv_pool.KVPoolSettings.from_dict(
    {"offload": True, "size_bytes": 2**20, "idle_exit_s": 1.0, "engine_ttl_s": 1.0})
large = kv_pool.KVPoolSettings.from_dict({**small.to_dict(), "size_bytes": 2**21, "idle_exit_s": 5.0})
out = {}
engine = subprocess.Popen(["sleep", "120"])  # stands in for an engine process
ray.get(kv_pool.get_node_pool(node, small).acquire_slot.remote("engine-1", engine.pid), timeout=60)
time.sleep(3)  # past idle_exit_s: the engine's process still holds its slot
out["held"] = sorted(kv_pool.list_pools())
# A redeploy with another size gets a pool of its own, not the old one.
out["large_bytes"] = ray.get(kv_pool.get_node_pool(node, large).stats.remote(), timeout=60)["shared_memory"]["bytes"]
out["both"] = sorted(kv_pool.list_pools())
engine.kill(); engine.wait()  # the app is deleted: its engines are gone
deadline = time.monotonic() + 30
while kv_pool.list_pools() and time.monotonic() < deadline:
    time.sleep(0.2)
out["after"] = sorted(kv_pool.list_pools())
out["names"] = [kv_pool.pool_name(node, small), kv_pool.pool_name(node, large)]
ray.shutdown()
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow
def test_a_pool_lives_while_engines_use_it_and_settings_get_their_own():
    """A node's pool actor (real Ray, engines stood in by a process holding
    a slot): kept while an engine holds its slot; a deploy with another
    size gets its own pool; once no engine uses them, both remove
    themselves (kv_pool.idle_exit_s) and their memory goes with them."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", POOL_LIFE], capture_output=True, text=True, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, (r.stdout[-2000:], r.stderr[-3000:])
    out = json.loads(line[0][len("RESULT "):])
    small, large = out["names"]
    assert small != large
    assert out["held"] == [small]
    assert out["large_bytes"] == 2**21 and out["both"] == sorted([small, large])
    assert out["after"] == [], out
