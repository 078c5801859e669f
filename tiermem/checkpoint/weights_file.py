"""Reading weights from the files users bring, one tensor at a time: a Hugging Face checkpoint
directory (``model.safetensors``, or shards named by ``model.safetensors.index.json``), one
``.safetensors`` file, or a torch state-dict file (``torch.save`` of a dict of tensors).

NOTE [Weights read one tensor at a time]
A model bigger than the machine is built from a checkpoint bigger than the machine, so nothing
here holds more than the tensor asked for. A safetensors file's header is checked by the
``safetensors`` package (parsed, and held against the file's size) when the checkpoint is opened;
each tensor is then read with one ``preadv`` into a fresh tensor, at the offset the header gives
(safetensors stores raw little-endian bytes): no memory map, whose touched pages would count in the
process's resident memory until it is closed. The reads arrive in the order construction
announced (:meth:`WeightsFile.expect`), and the kernel is asked to read ahead
(``posix_fadvise(WILLNEED)``) up to :data:`AHEAD` bytes past the tensor being read, into the page
cache, not this process: the disk works while the previous tensor is cast and written home. A torch file is
loaded with ``mmap=True, weights_only=True`` (no code runs, and its tensors are paged in when
read); its map stays until construction ends, so prefer safetensors for checkpoints larger than
the host's memory. :meth:`WeightsFile.entries` reads only headers: names, shapes and dtypes are
checked against the model before anything is built.

Out the same way (``save_pretrained``, ``ModelState.stream_weights``): each bucket's master is read
from its home and copied out one tensor at a time; an NVMe home reads the next bucket's master
into its other host set meanwhile (``NvmeState.read_masters``), so the disk reads while the writer
writes.

safetensors holds no checksum of its data: a byte flipped inside a tensor is read as written. A
truncated file or a header that does not fit the file is refused when the file is opened.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from tiermem.errors import ConfigError
from tiermem.memory.nvme_io import read_all
from tiermem.memory.nvme_layout import ShortRead, buffer_of

log = logging.getLogger(__name__)

__all__ = ["Entry", "WeightsFile", "open_weights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TORCH_NAMES = ("pytorch_model.bin", "model.pt", "model.pth")
AHEAD = 256 << 20  # bytes the kernel is asked to read ahead of the tensor being read (NOTE above)

#: safetensors' dtype names -> torch's
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint, known from its header: where it is, its shape and dtype."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = -1  # safetensors: where its bytes start in the file (-1: a torch file's tensor)
    nbytes: int = 0  # safetensors: how many bytes it holds

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _bad(path: str, why: str) -> ConfigError:
    return ConfigError(
        f"tiermem: weights={path!r}: {why}; pass a Hugging Face checkpoint directory, a .safetensors file or a "
        f"torch state-dict file"
    )


class WeightsFile:
    """The tensors of a checkpoint, by name. ``entries`` reads headers only; ``read`` one tensor."""

    def __init__(self, path: str, entries: dict[str, Entry]):
        self.path = path
        self.entries = entries
        self.opened: dict[str, Any] = {}  # torch file -> its loaded (memory-mapped) dict
        self._fds: dict[str, int] = {}  # safetensors file -> its descriptor, open until close()
        self._order: list[str] = []  # the reads announced by expect(), in order
        self._next: dict[str, int] = {}  # name -> its place in _order
        self._advised = 0  # _order[:_advised] has been asked of the kernel ahead
        self._spans: dict[str, tuple[int, int]] = {}  # name -> the elements to be read, when not all

    def expect(self, names: list[str], *, spans: Optional[Mapping[str, tuple[int, int]]] = None) -> None:
        """The tensors construction will read, in the order it reads them: the disk reads ahead
        along it (NOTE [Weights read one tensor at a time]). Any order stays correct. ``spans``:
        the elements ``[lo, hi)`` (of the flattened tensor) to be read of those read in part."""
        self._order, self._advised = list(names), 0
        self._spans = dict(spans or {})
        self._next = {n: i for i, n in reversed(list(enumerate(self._order)))}

    def read(self, name: str) -> torch.Tensor:
        """``name``'s tensor, in its stored dtype, on the CPU (a fresh tensor: nothing else holds it)."""
        e = self.entries[name]
        try:
            if e.offset >= 0:
                self._ahead(name)
                t = self._pread(e)
            else:
                t = self.opened[e.file][name].clone()  # loaded when its header was read
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            raise _bad(self.path, f"reading {name!r} from {e.file!r} failed ({type(err).__name__}: {err})") from err
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise _bad(self.path, f"{name!r} in {e.file!r} holds {tuple(t.shape)} {t.dtype}, its header said {e.shape}")
        return t

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``name``'s tensor flattened (row-major), in its stored dtype, on
        the CPU (a fresh tensor): of a safetensors file, those bytes alone are read."""
        e = self.entries[name]
        _check_span(e, lo, hi)
        try:
            if e.offset >= 0:
                self._ahead(name)
                t = torch.empty(hi - lo, dtype=e.dtype)
                self._pread_into(e, t, lo)
            else:  # a slice of the memory map: only its pages are read
                t = self.opened[e.file][name].reshape(-1)[lo:hi].clone()
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            raise _bad(self.path, f"reading {name!r} from {e.file!r} failed ({type(err).__name__}: {err})") from err
        return t

    def read_into(self, name: str, out: torch.Tensor, *, at: int = 0) -> bool:
        """Read elements ``[at, at + out.numel())`` of ``name``'s tensor flattened (all of it by
        default) straight into ``out`` (flat, contiguous, in host memory) when it is stored in
        ``out``'s dtype in a safetensors file: one copy fewer than :meth:`read_flat`. False:
        nothing was read (another dtype, or a torch file); call :meth:`read_flat`."""
        e = self.entries[name]
        _check_span(e, at, at + out.numel())
        if not (e.offset >= 0 and e.dtype == out.dtype and out.device.type == "cpu" and out.is_contiguous()):
            return False
        try:
            self._ahead(name)
            self._pread_into(e, out, at)
        except (OSError, ValueError) as err:
            raise _bad(self.path, f"reading {name!r} from {e.file!r} failed ({type(err).__name__}: {err})") from err
        return True

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def _pread(self, e: Entry) -> torch.Tensor:
        """``e``'s bytes, read into a fresh tensor of its shape and dtype; a short file is an error."""
        t = torch.empty(e.shape, dtype=e.dtype)
        self._pread_into(e, t)
        return t

    def _pread_into(self, e: Entry, t: torch.Tensor, at: int = 0) -> None:
        """Elements ``[at, at + t.numel())`` of ``e`` into ``t``, its own bytes written in place."""
        nbytes = t.numel() * e.dtype.itemsize
        if nbytes == 0:
            return
        offset = e.offset + at * e.dtype.itemsize  # row-major: a run of elements is a run of bytes
        try:
            read_all(os.preadv, self._fd(e.file), [buffer_of(t.reshape(-1).view(torch.uint8))], offset, nbytes)
        except ShortRead as err:
            raise ValueError(f"the file ends before {e.name!r} does (truncated?): {err}") from err

    def _bytes(self, name: str) -> tuple[int, int]:
        """Where the bytes to be read of ``name`` start in its file, and how many (:meth:`expect`'s span)."""
        e = self.entries[name]
        if e.offset < 0:
            return -1, 0  # a torch file's: paged in from its map, nothing to ask ahead
        lo, hi = self._spans.get(name, (0, e.numel))
        return e.offset + lo * e.dtype.itemsize, (hi - lo) * e.dtype.itemsize

    def _ahead(self, name: str) -> None:
        """Ask the kernel to read the announced tensors after ``name`` up to :data:`AHEAD` bytes."""
        at = self._next.get(name)
        if at is None:
            return
        self._advised, budget = max(self._advised, at + 1), AHEAD
        for later in self._order[at + 1 : self._advised]:
            budget -= self._bytes(later)[1]  # already asked for, still ahead of this read
        while self._advised < len(self._order) and budget > 0:
            e = self.entries[self._order[self._advised]]
            offset, nbytes = self._bytes(e.name)
            if e.offset >= 0 and nbytes:
                os.posix_fadvise(self._fd(e.file), offset, nbytes, os.POSIX_FADV_WILLNEED)
            budget -= nbytes
            self._advised += 1

    def close(self) -> None:
        """Let go of the files (and their memory maps)."""
        self.opened.clear()
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _check_span(e: Entry, lo: int, hi: int) -> None:
    assert 0 <= lo <= hi <= e.numel, f"elements [{lo}, {hi}) of {e.name!r}, which has {e.numel}"


def _open_one(file: str, path: str) -> Any:
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            return safe_open(file, framework="pt", device="cpu")
        except Exception as err:
            raise _bad(path, f"{file!r} is not a readable safetensors file ({type(err).__name__}: {err})") from err
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise _bad(path, f"{file!r} is not a readable torch state-dict file ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _bad(path, f"{file!r} holds a {type(state).__name__}, not a dict of tensors")
    return state


def _files(path: str) -> list[str]:
    """The files of the checkpoint at ``path``, in the order their headers are read."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise _bad(path, "no such file or directory")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise _bad(path, f"{INDEX} is not a shard index ({type(err).__name__}: {err})") from err
        names = sorted(set(weight_map.values()))
        for n in names:
            if os.path.basename(n) != n or not os.path.isfile(os.path.join(path, n)):
                raise _bad(path, f"{INDEX} names the shard {n!r}, which is not a file in the directory")
        return [os.path.join(path, n) for n in names]
    for name in (SINGLE, *TORCH_NAMES):
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    if os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(os.path.join(path, "tiermem.json")):
        raise ConfigError(
            f"tiermem: weights={path!r} is a tiermem (DCP) checkpoint, which holds optimizer state too; build the "
            f"model without weights= and call tm.load({path!r})"
        )
    raise _bad(path, f"the directory holds neither {INDEX}, {SINGLE} nor a torch file ({', '.join(TORCH_NAMES)})")


def _header(file: str, path: str, opened: dict[str, Any]) -> list[Entry]:
    """``file``'s entries; a torch file, loaded (memory-mapped) to read them, is kept in ``opened``
    for the reads that follow."""
    if not file.endswith(".safetensors"):
        opened[file] = _open_one(file, path)
        return [Entry(name, file, tuple(t.shape), t.dtype) for name, t in opened[file].items()]
    out = []
    with _open_one(file, path) as handle:  # the package checks the header against the file, first
        where = _offsets(file, path)
        for name in handle.keys():
            s = handle.get_slice(name)
            dtype = DTYPES.get(s.get_dtype())
            if dtype is None:
                raise _bad(path, f"{name!r} in {file!r} has dtype {s.get_dtype()}, which tiermem cannot load")
            shape = tuple(s.get_shape())
            offset, nbytes = where[name]
            numel = 1
            for d in shape:
                numel *= d
            if nbytes != numel * dtype.itemsize:
                raise _bad(
                    path, f"{name!r} in {file!r} holds {nbytes} bytes, not the {numel * dtype.itemsize} of {shape}"
                )
            out.append(Entry(name, file, shape, dtype, offset, nbytes))
    return out


def _offsets(file: str, path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's (first byte in the file, byte count), from the safetensors header: an 8-byte
    little-endian length, that many bytes of JSON, then the data its ``data_offsets`` index."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        return {
            name: (8 + size + int(v["data_offsets"][0]), int(v["data_offsets"][1]) - int(v["data_offsets"][0]))
            for name, v in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as err:
        raise _bad(path, f"{file!r} is not a readable safetensors file ({type(err).__name__}: {err})") from err


def open_weights(path: str | os.PathLike) -> WeightsFile:
    """The checkpoint at ``path``, its headers read and checked (no tensor data is read)."""
    path = os.fspath(path)
    entries: dict[str, Entry] = {}
    weights = WeightsFile(path, entries)
    for file in _files(path):
        for e in _header(file, path, weights.opened):
            if e.name in entries:
                raise _bad(path, f"{e.name!r} is in both {entries[e.name].file!r} and {e.file!r}")
            entries[e.name] = e
    return weights
