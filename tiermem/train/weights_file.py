"""Reading weights from the files users bring, one tensor at a time: a Hugging Face checkpoint
directory (``model.safetensors``, or shards named by ``model.safetensors.index.json``), one
``.safetensors`` file, or a torch state-dict file (``torch.save`` of a dict of tensors).

NOTE [Weights read one tensor at a time]
A model bigger than the machine is built from a checkpoint bigger than the machine, so nothing
here holds more than the tensor asked for. A safetensors file is opened through the
``safetensors`` package (its header is parsed and checked against the file's size when opened)
for each tensor read, and closed again: the pages of its memory map that the read touched would
otherwise stay mapped, and count in the process's resident memory, until the end. A torch file is
loaded with ``mmap=True, weights_only=True`` (no code runs, and its tensors are paged in when
read); its map stays until construction ends, so prefer safetensors for checkpoints larger than
the host's memory. :meth:`WeightsFile.entries` reads only headers: names, shapes and dtypes are
checked against the model before anything is built.

safetensors holds no checksum of its data: a byte flipped inside a tensor is read as written. A
truncated file or a header that does not fit the file is refused when the file is opened.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["Entry", "WeightsFile", "open_weights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TORCH_NAMES = ("pytorch_model.bin", "model.pt", "model.pth")

#: safetensors' dtype names -> torch's
_DTYPES = {
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

    def read(self, name: str) -> torch.Tensor:
        """``name``'s tensor, in its stored dtype, on the CPU (a fresh tensor: nothing else holds it)."""
        e = self.entries[name]
        try:
            if e.file.endswith(".safetensors"):
                with _open_one(e.file, self.path) as f:  # closed at once: NOTE [Weights read one tensor at a time]
                    t = f.get_tensor(name)
            else:
                t = self.opened[e.file][name].clone()  # loaded when its header was read
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            raise _bad(self.path, f"reading {name!r} from {e.file!r} failed ({type(err).__name__}: {err})") from err
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise _bad(self.path, f"{name!r} in {e.file!r} holds {tuple(t.shape)} {t.dtype}, its header said {e.shape}")
        return t

    def close(self) -> None:
        """Let go of the files (and their memory maps)."""
        self.opened.clear()


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
    with _open_one(file, path) as handle:
        for name in handle.keys():
            s = handle.get_slice(name)
            dtype = _DTYPES.get(s.get_dtype())
            if dtype is None:
                raise _bad(path, f"{name!r} in {file!r} has dtype {s.get_dtype()}, which tiermem cannot load")
            out.append(Entry(name, file, tuple(s.get_shape()), dtype))
    return out


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
