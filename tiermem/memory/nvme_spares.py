"""The NVMe store's spare files: slot files released by a write, kept for the next write to go
over in place. NOTE [One value per key, and a few spare files] in :mod:`tiermem.memory.nvme_keys`."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from typing import Optional

from tiermem.errors import OutOfTierMemory
from tiermem.memory import nvme_layout as layout
from tiermem.memory.ledger import Ledger

SPARES = "<spare files>"  # the ledger key of the pool's files
_SPARE_PREFIX = "spare-"
# a spare's whole name; never a slot file's, which is "<readable>.<16 hex digits>.<slot>.tmn"
_SPARE_NAME = re.compile(rf"{_SPARE_PREFIX}[0-9]+{re.escape(layout.SUFFIX)}")


class SparePool:
    """Files that held a key's previous value, kept for the next write to go over in place (NOTE
    [One value per key, and a few spare files]). The store calls every method with its lock held;
    renaming a file in or out is the caller's, outside the lock."""

    def __init__(self, directory: str, limit: int, ledger: Ledger):
        self.directory, self.limit, self.ledger = directory, limit, ledger
        self.ready: dict[str, int] = {}  # path -> file size, free to take
        self.arriving: dict[str, int] = {}  # given, not renamed in yet
        for name in sorted(os.listdir(directory)) if limit else ():  # left by a killed run: their blocks are reused
            path = os.path.join(directory, name)
            if _SPARE_NAME.fullmatch(name) and len(self.ready) < limit:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    self.ready[path] = st.st_size
        self._next = len(self.ready)
        with contextlib.suppress(OutOfTierMemory):  # too big for the budget: not adopted, left as they are
            self._count()

    def take(self, want: int) -> Optional[str]:
        """A ready spare for a file of ``want`` bytes (half to twice that size: close enough that
        the write reuses most of its blocks and wastes few), or None."""
        fits = [(abs(size - want), path) for path, size in self.ready.items() if want // 2 <= size <= 2 * want]
        if not fits:
            return None
        path = min(fits)[1]
        del self.ready[path]
        self._count()
        return path

    def give(self, size: int) -> Optional[str]:
        """Where to rename a released file of ``size`` bytes to keep it (then :meth:`keep`), or
        None: unlink it (the pool holds ``limit`` files of its size band already, or the budget
        cannot hold it)."""
        held = [s for s in (*self.ready.values(), *self.arriving.values()) if _band(s) == _band(size)]
        if len(held) >= self.limit:
            return None
        while (path := os.path.join(self.directory, f"{_SPARE_PREFIX}{self._next}{layout.SUFFIX}")) in self.ready:
            self._next += 1
        self._next += 1
        self.arriving[path] = size
        try:
            self._count()
        except OutOfTierMemory:
            del self.arriving[path]
            return None
        return path

    def keep(self, path: str, renamed: bool) -> None:
        """``path`` (from :meth:`give`) was renamed in (or that failed: forget it)."""
        size = self.arriving.pop(path)
        if renamed:
            self.ready[path] = size
        self._count()

    def drop_all(self) -> None:
        """Unlink every ready spare and give its bytes back to the budget."""
        for path in self.ready:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.ready.clear()
        self._count()

    def _count(self) -> None:
        held = sum(max(0, size - layout.HEADER) for size in (*self.ready.values(), *self.arriving.values()))
        if held:
            self.ledger.reserve(SPARES, held)
        else:
            self.ledger.release(SPARES)


def _band(size: int) -> int:
    """The pool's size band of a file: sizes within the same power of two share one band, so a
    store that writes values of several sizes (a model's bf16 weights and its optimizer state)
    keeps spares of each instead of the more frequent size crowding out the others."""
    return size.bit_length()
