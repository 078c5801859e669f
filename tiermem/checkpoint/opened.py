"""A checkpoint directory opened once for a load: the directory itself and every file in it that
the load reads, each opened once (relative to the directory's descriptor, never through a
symlink) and read through that descriptor only (NOTE [A load reads the files it checked]). No
torch.distributed.checkpoint here.

# NOTE [A load reads the files it checked]
A save publishes a new checkpoint by exchanging directories (NOTE [Checkpoint directories]);
the previous one is then unlinked file by file. A load that reopened files by name after its
checks could hash the old ``.metadata`` and read the new data files, or the reverse: a mix of two
checkpoints that passes every check. So a load opens the directory once (``O_DIRECTORY``), lists
it once, opens each file it needs relative to that descriptor (``dir_fd``, ``O_NOFOLLOW``: a
symlink is refused, so no name reaches outside the directory), and hashes and reads every byte
through those descriptors with ``pread``. A concurrent publish renames and unlinks names; the
inodes a load holds stay as they were, so the load sees one checkpoint whole, or (where the
directory was emptied before it opened a file) a ``tiermem:`` error.

Every read is bounded before it is made: by the file's real size (``fstat``) and by a cap for
what is parsed in memory (a manifest, DCP's ``.metadata``, the ``tiermem`` record), so a file
that claims gigabytes costs neither the memory nor the time before it is refused.
"""

from __future__ import annotations

import errno
import io
import os
import stat

import xxhash

from tiermem.errors import StoreError

#: the most bytes of one record parsed in memory (a manifest, DCP's metadata, the meta record);
#: tiermem's own are a few hundred bytes per tensor
RECORD_CAP = 256 << 20
_CHUNK = 64 << 20


class OpenDir:
    """The directory ``path``, opened once; its files opened on first use and kept open until
    :meth:`close`. Every error is a ``tiermem:`` :class:`StoreError` naming the file."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise self.bad(f"cannot open it: {e.strerror or e}") from None
        try:
            self.names = frozenset(os.listdir(self.fd))
        except OSError as e:
            os.close(self.fd)
            raise self.bad(f"cannot list it: {e.strerror or e}") from None
        self._files: dict[str, tuple[int, int]] = {}  # name -> (descriptor, size)

    def bad(self, why: str) -> StoreError:
        return StoreError(
            f"tiermem: {self.path!r} is not a readable tiermem checkpoint ({why}); nothing was loaded. "
            f"Pass a directory written by tm.save(), unedited"
        )

    def _open(self, name: str) -> tuple[int, int]:
        if name not in self._files:
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise self.bad(f"{name!r} names a file outside the checkpoint directory")
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise self.bad(f"{name!r} is a symlink, which tm.save never writes: it is not followed") from None
                raise StoreError(
                    f"tiermem: checkpoint {self.path!r} is incomplete: cannot read {name!r} "
                    f"({e.strerror or e}); nothing was loaded. Use another checkpoint"
                ) from None
            mode, size = os.fstat(fd).st_mode, os.fstat(fd).st_size
            if not stat.S_ISREG(mode):
                os.close(fd)
                raise self.bad(f"{name!r} is not a regular file")
            self._files[name] = (fd, size)
        return self._files[name]

    def size(self, name: str) -> int:
        return self._open(name)[1]

    def read(self, name: str, offset: int = 0, length: int | None = None, cap: int | None = None) -> bytes:
        """``length`` bytes (default: to the end) of ``name`` from ``offset``: within the file's
        size and at most ``cap`` bytes, checked before anything is read."""
        fd, size = self._open(name)
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise self.bad(f"{name!r} holds {size} bytes, not [{offset}, {offset + length})")
        if cap is not None and length > cap:
            raise self.bad(f"{name!r} claims {length} bytes, more than a checkpoint's record may hold ({cap})")
        out = bytearray(length)
        view, got = memoryview(out), 0
        while got < length:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise self.bad(f"{name!r} ended at {offset + got} bytes while being read")
            got += n
        return bytes(out)

    def hash(self, name: str) -> tuple[int, str]:
        """(bytes, xxh3_64) of ``name``, read in chunks into one buffer."""
        fd, size = self._open(name)
        h, at = xxhash.xxh3_64(), 0
        buf = memoryview(bytearray(min(_CHUNK, max(1, size))))
        while n := os.preadv(fd, [buf], at):
            h.update(buf[:n])
            at += n
        return at, h.hexdigest()

    def view(self, name: str, offset: int, length: int) -> io.BufferedReader:
        """Bytes ``[offset, offset + length)`` of ``name`` as a read-only, seekable file of its own
        (``torch.load`` reads a tensor's storage straight from it, as DCP's file views do)."""
        fd, size = self._open(name)
        if offset < 0 or length < 0 or offset + length > size:
            raise self.bad(f"{name!r} holds {size} bytes, not [{offset}, {offset + length})")
        return io.BufferedReader(_Slice(fd, offset, length))

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        os.close(self.fd)

    def __enter__(self) -> "OpenDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Slice(io.RawIOBase):
    """``length`` bytes of the open file ``fd`` from ``start``, read with ``pread`` (the
    descriptor's own offset is never moved, so any number of slices of one file may be open)."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.at = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.length}[whence]
        self.at = max(0, base + offset)
        return self.at

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.at))
        got = os.preadv(self.fd, [view[:n]], self.start + self.at) if n else 0
        self.at += got
        return got
