"""The NVMe store's directory: its options and directory checked, O_DIRECT probed once (the
one probe: ``tiermem info`` and ``bench`` report what it finds), and the lock that makes one
store its owner.

# NOTE [One store owns a directory]
Two runs on one directory would overwrite each other's slot files and train on each other's
state. A store takes an exclusive ``flock`` on ``tiermem.lock`` in its directory when it is made
(the file is 0600, opened without following a symlink) and writes its pid there; another store
(this process or another) gets an error naming that pid. ``close()`` removes the file and lets
go; a store nothing references any more lets go when it is collected, so a store made in this
process that the holder's pid names first collects garbage (and waits for what dropped models
give back: NOTE [Finalizers only enqueue] in :mod:`tiermem.memory.deferred`) and tries once more. The lock dies
with the process (the kernel drops it), so a killed run never leaves the directory locked: a
file left behind is taken over. The file is removed while still locked, and a store that got
the lock checks that the file it locked is still the one at the path, else it tries again.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import platform
import uuid
from typing import Optional

from tiermem.config.rules import is_int
from tiermem.errors import ConfigError
from tiermem.memory import deferred
from tiermem.memory.aligned import ALIGN, aligned_empty

log = logging.getLogger(__name__)


def check_options(io_threads: object, block_size: object) -> None:
    if not is_int(io_threads) or io_threads < 1:
        raise ConfigError(f"tiermem: NvmeStore.io_threads={io_threads!r} must be an int >= 1; pass e.g. io_threads=8")
    if not is_int(block_size) or block_size < ALIGN or block_size % ALIGN:
        raise ConfigError(
            f"tiermem: NvmeStore.block_size={block_size!r} must be a positive multiple "
            f"of {ALIGN} bytes (direct I/O needs aligned lengths); pass e.g. 8 * 2**20"
        )


def check_journal(keep_previous: object, spares: object) -> None:
    if not isinstance(keep_previous, bool):
        raise ConfigError(f"tiermem: NvmeStore.keep_previous={keep_previous!r} must be True or False")
    if not is_int(spares) or spares < 0:
        raise ConfigError(f"tiermem: NvmeStore.spares={spares!r} must be an int >= 0; pass e.g. spares=4")


def check_directory(directory: str) -> None:
    if not os.path.exists(directory):
        raise ConfigError(
            f"tiermem: NvmeStore directory {directory} does not exist; create it first "
            f"(mkdir -p {directory}) or pass an existing directory as nvme_dir"
        )
    if not os.path.isdir(directory):
        raise ConfigError(f"tiermem: NvmeStore directory {directory} is not a directory; pass a directory as nvme_dir")


LOCK_NAME = "tiermem.lock"


class DirectoryLock:
    """The lock of NOTE [One store owns a directory]: :meth:`acquire` or a ConfigError naming the
    holder; :meth:`release` is idempotent (a finalizer may call it after ``close``)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        collected = False
        for _ in range(8):  # a releasing store may unlink the file between our open and flock
            fd = _open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if holder == str(os.getpid()) and not collected:  # perhaps a store nothing references
                    collected = True
                    deferred.collect()  # and a dropped model's store, given back on the release worker
                    continue
                raise ConfigError(self._held(holder)) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
            return
        raise ConfigError(
            f"tiermem: could not take the lock {self.path}: it kept being replaced; make sure "
            f"no other run uses this directory, or pass another nvme_dir"
        )

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)  # still locked: no other store takes a file about to vanish
        except OSError:
            pass
        os.close(fd)  # lets go of the flock

    def _held(self, holder: str) -> str:
        who = (
            "this process (pid " + holder + "): close the other NvmeStore first, or tm.detach() the "
            "TieredModel that uses it (or drop every reference to it: `del tm` before building the next "
            "one)"
            if holder == str(os.getpid())
            else f"process {holder or '(pid not written yet)'}: stop that run first"
        )
        return (
            f"tiermem: NVMe directory {os.path.dirname(self.path)} is in use by another NvmeStore, in "
            f"{who}, or pass another nvme_dir (one run owns a directory: lock file {self.path})"
        )


def _open_lock_file(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(
                f"tiermem: the NVMe lock file {path} is a symbolic link, which tiermem never "
                f"follows; remove it, and find out who planted it"
            ) from e
        raise ConfigError(
            f"tiermem: cannot create the NVMe lock file {path} ({e.strerror}); make the "
            f"directory writable or pass another nvme_dir"
        ) from e


CHECKSUMS_ENV = "TIERMEM_NVME_CHECKSUMS"


def checksums_wanted(directory: str) -> bool:
    """Whether a new store checks its data (NOTE [Data checksums]): yes unless the environment
    sets TIERMEM_NVME_CHECKSUMS=0, a benchmarking switch that measures what the checks cost."""
    value = os.environ.get(CHECKSUMS_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise ConfigError(
            f"tiermem: {CHECKSUMS_ENV}={value!r} must be 0 or 1; unset it (checksums on, "
            f"the default) or set it to 0 only to measure their cost"
        )
    if value == "0":
        log.warning(
            "tiermem: %s=0: the NVMe store in %s does not check its data; a byte damaged on disk "
            "will be read back silently. This switch is for benchmarks only: unset it to train",
            CHECKSUMS_ENV,
            directory,
        )
        return False
    return True


def choose_direct(directory: str, direct: Optional[bool]) -> bool:
    """Whether the store uses O_DIRECT in ``directory``: ``direct`` True insists (a clear error
    where the filesystem refuses it), None falls back to buffered I/O with one warning."""
    supported, refused = probe_direct(directory, direct)
    if refused is not None and direct:
        raise ConfigError(
            f"tiermem: NvmeStore(direct=True) but {directory} refuses O_DIRECT "
            f"({refused.strerror}); pass direct=None to fall back to buffered I/O, or "
            f"put nvme_dir on a filesystem with direct I/O (ext4, xfs)"
        )
    if refused is not None:
        log.warning(
            "tiermem: %s refuses O_DIRECT (%s): NvmeStore falls back to buffered I/O through "
            "the page cache, which is slower and takes RAM; put nvme_dir on a filesystem "
            "with direct I/O (ext4, xfs) to avoid this",
            directory,
            refused.strerror,
        )
    return supported


def probe_direct(directory: str, direct: Optional[bool]) -> tuple[bool, Optional[OSError]]:
    """Create, write and remove one small probe file: fails unless the directory takes files.
    Returns whether O_DIRECT works there (never tried when ``direct`` is False) and, when it
    does not, the error the filesystem gave. The one O_DIRECT probe: the store decides with it
    and ``tiermem info`` and ``bench`` report it (:func:`describe_direct`)."""
    try:
        return _probe(directory, direct)
    except OSError as e:
        raise ConfigError(
            f"tiermem: NvmeStore cannot create files in {directory} ({e.strerror}); "
            f"make it writable or pass a writable directory as nvme_dir"
        ) from e


def describe_direct(directory: str) -> tuple[bool, str]:
    """For a report: whether the NVMe store would use O_DIRECT in ``directory`` and, when not,
    why in words (empty when it would). Never raises."""
    try:
        supported, refused = _probe(directory, None)
    except OSError as e:
        return False, f"cannot create a file there ({e.strerror})"
    if supported:
        return True, ""
    assert refused is not None  # asked with direct=None: a refusal comes with its error
    why = "the filesystem refuses it" if refused.errno == errno.EINVAL else refused.strerror
    return False, f"{why} (the NVMe store falls back to buffered I/O)"


def _probe(directory: str, direct: Optional[bool]) -> tuple[bool, Optional[OSError]]:
    """:func:`probe_direct`, raising the OSError of a directory that takes no files."""
    path = os.path.join(directory, f"tiermem-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    refused: Optional[OSError] = None
    if direct is not False and not hasattr(os, "O_DIRECT"):
        refused = OSError(errno.EOPNOTSUPP, f"O_DIRECT does not exist on {platform.system()}")
    elif direct is not False:
        try:
            _probe_write(path, os.O_DIRECT)
            return True, None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            refused = e
    _probe_write(path, 0)
    return False, refused


def _probe_write(path: str, extra_flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags, 0o600)
    try:
        block = aligned_empty(ALIGN, pin=False).zero_()
        os.pwrite(fd, memoryview(block.numpy()), 0)  # type: ignore[arg-type]  # numpy's stubs: no buffer protocol
    finally:
        os.close(fd)
        os.unlink(path)
