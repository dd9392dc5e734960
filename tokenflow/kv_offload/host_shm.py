"""A node's host KV pool as one shared-memory file, carved into engine slots.

The node's KV pool actor (tokenflow/serve/kv_pool.py) creates the file, commits all of
its memory at once (so a pool that does not fit fails at start, not mid-burst)
and unlinks it right away: the file then lives exactly as long as some
process holds it, so a crashed or killed cluster never leaves pool memory
behind in /dev/shm. Engines on the node open it through the actor's
descriptor (`/proc/<actor pid>/fd/<fd>`) and map only their own slot.

A slot outlives its engine: a restarted replica gets a slot whose holder is
gone and reuses that memory; the node never allocates a second copy. A slot
counts as held while its holder's pid is alive or any live process still
maps its byte range (an engine's worker processes can outlive the replica
for a moment).

No vLLM or Ray import here: the actor and the worker both use it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import asdict, dataclass

PAGE = mmap.ALLOCATIONGRANULARITY  # mmap offsets must be multiples of this
PREFIX = "tokenflow-kv-"


@dataclass(frozen=True)
class Region:
    """One engine's slot of a node pool file: what the engine maps."""

    path: str  # /proc/<actor pid>/fd/<fd> on the pool's node
    offset: int
    nbytes: int
    slot: int
    inode: int  # identifies the (unlinked) file in /proc/*/maps

    EXTRA_KEY = "host_pool_shm"  # its key in kv_connector_extra_config

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_extra(cls, extra) -> "Region | None":
        d = extra.get(cls.EXTRA_KEY)
        return cls(**d) if d else None

    def part(self, index: int, nbytes: int) -> "Region":
        """The index-th of equal consecutive parts of nbytes (one per worker
        of a tensor-parallel engine)."""
        start = index * nbytes
        if start + nbytes > self.nbytes:
            raise ValueError(f"kv_offload: worker {index} needs bytes up to {start + nbytes}, "
                             f"the engine's slot has {self.nbytes}")
        return Region(self.path, self.offset + start, nbytes, self.slot, self.inode)


def slot_bytes(total_bytes: int, slots: int) -> int:
    """Each slot's size: an equal share, whole pages (mmap offsets)."""
    return (total_bytes // slots) // PAGE * PAGE


class PoolFile:
    """The node's pool memory, held open by the actor that created it."""

    def __init__(self, shm_dir: str, name: str, nbytes: int):
        path = os.path.join(shm_dir, PREFIX + name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.unlink(path)  # see the module docstring: no leftovers, ever
            os.ftruncate(fd, nbytes)
            # Commits the memory now; tmpfs answers ENOSPC if it is too small.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"cannot commit a {nbytes}-byte host KV pool in {shm_dir} "
                                   f"({e.strerror}); make kv_pool.size_bytes smaller") from e
        self.fd = fd
        self.nbytes = nbytes
        self.inode = os.fstat(fd).st_ino
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    def region(self, slot: int, size: int) -> Region:
        return Region(self.path, slot * size, size, slot, self.inode)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_region(region: Region):
    """The region as a flat int8 tensor, every page faulted in now (so the
    engine's resident memory does not creep up as rows are first used).
    Slots start on a page; a worker's part of one may not (mmap needs a page
    offset), so the mapping starts at the page before it."""
    import torch

    skip = region.offset % PAGE
    fd = os.open(region.path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, skip + region.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       offset=region.offset - skip)
    finally:
        os.close(fd)  # the mapping keeps the file alive
    return torch.frombuffer(mm, dtype=torch.int8)[skip:]  # keeps mm alive


def mapped_ranges(inode: int, proc: str = "/proc") -> dict[int, list[tuple[int, int]]]:
    """pid -> file byte ranges it maps of the pool file with this inode."""
    out: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) < 6 or int(fields[4]) != inode or PREFIX not in fields[5]:
                        continue
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    start = int(fields[2], 16)
                    out.setdefault(int(entry), []).append((start, start + hi - lo))
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return out


def pid_alive(pid: int | None, proc: str = "/proc") -> bool:
    """The process exists and is not a zombie (a killed replica stays one
    until its parent reaps it)."""
    if not pid:
        return False
    try:
        with open(f"{proc}/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
