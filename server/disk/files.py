"""The disk tier's files and the threads that read and write them.

One directory per node (``--disk-path``) holds:

- ``pages.dat``: ``slabs`` slabs of ``slab_size`` bytes, each cut into slots of one
  size (server/disk/layout.py). The file grows a slab at a time (``fallocate``) when
  the allocator first hands out a slab, so an unused capacity takes no space and a
  full filesystem shows up as ENOSPC on a slab's first use, not as a node that
  cannot start. It never exceeds ``slabs * slab_size`` bytes.
- ``slabs.map``: the slot size each slab was last cut into (8 bytes per slab), so
  recovery knows where the record headers lie.
- ``state.json``: the format, the slab size and the node's last incarnation.
- ``lock``: held (``flock``) while a node uses the directory: a second node on the
  same path is refused, and a node that finds it free knows its predecessor is dead.

Direct I/O (O_DIRECT) is used where the filesystem takes it; tmpfs and some overlay
filesystems refuse it, and then the files are opened for buffered I/O, said in one
log line at start and in ``kvstore_disk_direct_io``.

Why threads and not io_uring: measured on this machine's virtio disk (ext4), 2 MiB
direct reads, `fio` with four threads of ``psync`` (pread) 1,332 MiB/s against its
``io_uring`` engine at queue depth 4 1,241 MiB/s (bench/tier.py prints the same
comparison beside kvstore's own reads). The device, not the submission path, is the
limit at page sizes of hundreds of KiB and more; ``preadv``/``pwritev`` release the
GIL, and four reader threads keep four requests at the device, without a dependency
on a liburing build. Reads and writes have separate threads, so a read never waits
behind a backlog of demotions."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.errors import SetupError
from server.disk.layout import BLOCK, HEADER_BYTES

log = logging.getLogger(__name__)

FORMAT = 1
DATA_FILE = "pages.dat"
MAP_FILE = "slabs.map"
STATE_FILE = "state.json"
LOCK_FILE = "lock"
# Bytes of the capacity kept for the map, the state file and the lock: the files
# together never exceed --disk-capacity.
META_RESERVE = 1 << 20


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer (mmap), as direct I/O needs."""
    return mmap.mmap(-1, max(nbytes, BLOCK))


class DiskFiles:
    """Opens (or creates) the tier's directory and does its I/O. ``read``/``write``
    run on the calling thread (the tier calls them on ``readers``/``writers``)."""

    def __init__(self, directory: str, capacity: int, slab_size: int, queue_depth: int = 4) -> None:
        if slab_size % BLOCK:
            raise SetupError(
                f"slab size {slab_size} must be a multiple of {BLOCK} bytes for the disk tier"
            )
        self.directory = directory
        try:
            os.makedirs(directory, exist_ok=True)
            self._lock_fd = os.open(
                os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise SetupError(f"cannot use disk path {directory}: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SetupError(
                f"disk path {directory} is in use by another node process: give every node its own --disk-path"
            ) from None
        self.slab_size = slab_size
        self.slabs = max(0, (capacity - META_RESERVE) // slab_size)
        if self.slabs < 1:
            raise SetupError(
                f"disk capacity {capacity} bytes holds no slab of {slab_size} bytes (plus {META_RESERVE} for metadata)"
            )
        self.capacity = self.slabs * slab_size
        self.state = self._read_state()
        if self.state.get("format") != FORMAT or self.state.get("slab_size") != slab_size:
            if self.state:
                log.warning(
                    "disk tier in %s was written with slab size %s (format %s): starting it empty",
                    directory,
                    self.state.get("slab_size"),
                    self.state.get("format"),
                )
            self._reset()
        self.direct = _supports_direct_io(directory)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        self.data_fd = os.open(os.path.join(directory, DATA_FILE), flags, 0o600)
        self.map_fd = os.open(
            os.path.join(directory, MAP_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        size = os.fstat(self.data_fd).st_size
        if size > self.capacity:  # the capacity shrank since: slabs past it are gone
            os.ftruncate(self.data_fd, self.capacity)
            size = self.capacity
        self.slab_classes = self._read_map(size)
        self._grown = size // slab_size  # slabs the file already holds
        self._prepare_lock = threading.Lock()
        self.readers = ThreadPoolExecutor(queue_depth, thread_name_prefix="kvstore-disk-read")
        self.writers = ThreadPoolExecutor(
            max(1, queue_depth // 2), thread_name_prefix="kvstore-disk-write"
        )
        self.dirty = False  # written since the last sync

    # ---- metadata -----------------------------------------------------------------

    def _read_state(self) -> dict:
        try:
            with open(os.path.join(self.directory, STATE_FILE)) as f:
                state = json.load(f)
            return state if isinstance(state, dict) else {}
        except (OSError, ValueError):
            return {}

    def write_state(self, **fields: object) -> None:
        """Replace state.json atomically (write, fsync, rename)."""
        self.state.update(fields, format=FORMAT, slab_size=self.slab_size)
        path = os.path.join(self.directory, STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def _reset(self) -> None:
        for name in (DATA_FILE, MAP_FILE):
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        self.state = {}
        self.write_state()

    def _read_map(self, data_size: int) -> list[int]:
        """Slot size of each slab (0: never cut), for the slabs the data file holds."""
        raw = os.pread(self.map_fd, 8 * self.slabs, 0)
        classes = np.zeros(self.slabs, dtype="<u8")
        got = np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<u8")
        classes[: len(got)] = got
        classes[data_size // self.slab_size :] = (
            0  # slabs the file does not hold (a truncated grow)
        )
        return [int(c) if c and self.slab_size // c else 0 for c in classes]

    def prepare_slab(self, index: int, slot_size: int) -> None:
        """Before the first record of a slab cut into ``slot_size`` slots is written: the
        file holds the slab (grown with fallocate; ENOSPC raises) and the map says its
        slot size. Idempotent; called on writer threads."""
        with self._prepare_lock:
            if index >= self._grown:
                os.posix_fallocate(
                    self.data_fd,
                    self._grown * self.slab_size,
                    (index + 1 - self._grown) * self.slab_size,
                )
                self._grown = index + 1
            if self.slab_classes[index] != slot_size:
                os.pwrite(self.map_fd, int(slot_size).to_bytes(8, "little"), 8 * index)
                self.slab_classes[index] = slot_size

    # ---- records ------------------------------------------------------------------

    def write_record(self, offset: int, header: bytes, data: memoryview) -> None:
        """Header and page bytes (``data``, a multiple of 4 KiB) at ``offset`` in one call."""
        head = aligned_buffer(HEADER_BYTES)
        head[:] = header
        expected = HEADER_BYTES + len(data)
        written = os.pwritev(self.data_fd, [head, data], offset)
        if written != expected:
            raise OSError(errno.EIO, f"short write: {written} of {expected} bytes")
        self.dirty = True

    def read_record(self, offset: int, data: memoryview) -> bytes:
        """Read a record's header (returned) and its page bytes into ``data``."""
        head = aligned_buffer(HEADER_BYTES)
        expected = HEADER_BYTES + len(data)
        got = os.preadv(self.data_fd, [head, data], offset)
        if got != expected:
            raise OSError(errno.EIO, f"short read: {got} of {expected} bytes")
        return bytes(head)

    def read_header(self, offset: int) -> bytes:
        head = aligned_buffer(HEADER_BYTES)
        got = os.preadv(self.data_fd, [head], offset)
        return bytes(head[:got])

    def erase_header(self, offset: int) -> None:
        """Zero a record's header, so recovery does not bring back a page that was evicted."""
        os.pwritev(self.data_fd, [aligned_buffer(HEADER_BYTES)], offset)
        self.dirty = True

    def sync(self) -> None:
        """Make what was written durable (the data file and the map)."""
        if self.dirty:
            self.dirty = False
            os.fdatasync(self.data_fd)
            os.fdatasync(self.map_fd)

    def slot_offsets(self) -> list[tuple[int, int]]:
        """Every (offset, slot size) a record may lie at, from the map."""
        out: list[tuple[int, int]] = []
        for index, slot in enumerate(self.slab_classes):
            if slot:
                base = index * self.slab_size
                out.extend((base + k * slot, slot) for k in range(self.slab_size // slot))
        return out

    def close(self) -> None:
        """At shutdown (``DiskTier.stop``): let queued I/O finish, sync, release the lock."""
        self.readers.shutdown(wait=True)
        self.writers.shutdown(wait=True)
        try:
            self.sync()
        except OSError:
            pass
        for fd in (self.data_fd, self.map_fd, self._lock_fd):
            os.close(fd)


def _supports_direct_io(directory: str) -> bool:
    """Whether the filesystem under ``directory`` takes O_DIRECT reads and writes: tmpfs
    refuses the open (EINVAL), some overlay filesystems the first write."""
    path = os.path.join(directory, ".direct-io-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [aligned_buffer(BLOCK)], 0)
        os.preadv(fd, [aligned_buffer(BLOCK)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
