"""``tm.save_pretrained(directory)``: the weights in the ecosystem's format, streamed from their homes.

NOTE [Saving in the Hugging Face format]
The weights are read from their homes one tensor at a
time (:meth:`tiermem.checkpoint.view.StateReader.stream_weights`) and written as safetensors shards of
at most ``max_shard_size`` bytes each (one tensor larger than that gets a shard of its own), with
``model.safetensors.index.json`` when there is more than one shard, and the model's
``config.json`` (and ``generation_config.json``) when it is a transformers model, so that
``AutoModel*.from_pretrained(directory)`` and ``TieredModel(..., weights=directory)`` read it.
A tied weight is written once, under the module's own name for it (the
first in ``named_parameters()``), as transformers writes it. Everything is written into a new
directory beside ``directory`` and moved in when complete: a save that fails leaves what was there;
a save over an earlier one removes that one's shards and index, and nothing else.

A peft model (``peft.get_peft_model(...)``) is saved as peft's own ``save_pretrained`` saves it:
its active adapter only, ``adapter_model.safetensors`` under peft's names (from
``peft.get_peft_model_state_dict``, given the trained values: the frozen base is never read) and
``adapter_config.json``, which ``PeftModel.from_pretrained(base, directory)`` loads.

NOTE [Shards written as they are read]
The ``safetensors`` package writes a file from a dict of every tensor in it: a shard whole in
host memory, read before a byte of it is written. Here each tensor is written as soon as it is
read, by one writer thread, while the next ones are read from their homes: the disk reads and
writes at once, and host memory is :data:`WINDOW` bytes of tensors in flight, whatever the shard
size. The format allows it: an 8-byte little-endian length, a JSON header that may end in spaces,
then the tensors' bytes at the offsets the header gives. The data starts after room reserved for
the longest header the model's names could need; the header, padded with spaces to that room, is
written last, and the file is flushed to the disk (``fsync``) before the save is published.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import torch

from tiermem.checkpoint.view import ModelState, StateReader
from tiermem.checkpoint.weights_file import DTYPES
from tiermem.config.budgets import parse_bytes
from tiermem.errors import ConfigError, StoreError
from tiermem.memory.nvme_io import write_all
from tiermem.memory.nvme_layout import buffer_of
from tiermem.observe.progress import Progress

__all__ = ["save_pretrained"]

INDEX = "model.safetensors.index.json"
ADAPTER = "adapter_model.safetensors"
_CODES = {dtype: code for code, dtype in DTYPES.items()}  # torch dtype -> safetensors' name
WINDOW = 256 << 20  # bytes of tensors read but not yet written, at most (NOTE [Shards written as they are read])


def _tensors(reader: StateReader, dtype: Optional[torch.dtype], alloc: Alloc) -> Iterator[tuple[str, torch.Tensor]]:
    for names, value in reader.stream_weights(dtype=dtype or torch.float32, alloc=alloc):  # rounded once
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        yield names[0], value.contiguous()
    for name, value in reader.buffer_values():
        yield name, value.contiguous()


def save_pretrained(
    state: ModelState,
    module: torch.nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GiB",
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write ``state``'s weights (fp32 masters, or ``dtype``) and buffers to ``directory`` as
    safetensors shards, with the config of a transformers ``module`` (NOTE [Saving in the Hugging
    Face format])."""
    directory = os.fspath(directory)
    if _adapter(module) is not None:
        return _save_adapter(state.reader, module, directory, dtype)
    limit = parse_bytes(max_shard_size, what="max_shard_size")
    if limit < 1:
        raise ConfigError(f"tiermem: max_shard_size={max_shard_size!r} is invalid: must be at least 1 byte")
    width = torch.finfo(dtype).bits // 8 if dtype is not None else 4
    with _work_dir(directory) as work:
        progress = Progress(f"writing {directory}", sum(p.numel() * width for p in module.parameters()))
        weight_map: dict[str, str] = {}
        largest = max((p.numel() * width for p in module.parameters()), default=0)
        files, total = _write_shards(
            lambda alloc: _tensors(state.reader, dtype, alloc), limit, work, _header_room(module), progress, largest
        )
        progress.close()
        names = _final_names(len(files))
        for i, (names_in, final) in enumerate(zip(files, names)):
            os.replace(os.path.join(work, f"part-{i:05d}.safetensors"), os.path.join(work, final))
            weight_map.update(dict.fromkeys(names_in, final))
        if len(names) > 1:
            with open(os.path.join(work, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        _save_config(module, work)
        _publish(work, directory)


def _header_room(module: torch.nn.Module) -> int:
    """Bytes that hold the safetensors header of any shard of ``module``: every name it could
    write, with its dtype, shape and offsets at their longest (NOTE [Shards written as they are read])."""
    room = 64  # the metadata and the braces
    for name, t in module.state_dict(keep_vars=True).items():
        room += len(json.dumps(name)) + 96 + 21 * t.dim()  # dtype, keys, two 20-digit offsets, each dimension
    return -(-room // 8) * 8


class _Shard:
    """One safetensors file written as its tensors arrive (on the writer thread, in order)."""

    def __init__(self, path: str, room: int):
        self.path, self.room, self.at = path, room, 0
        self.entries: dict[str, dict[str, Any]] = {}
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            write_all(os.pwritev, self.fd, [buffer_of(t.reshape(-1).view(torch.uint8))], 8 + self.room + self.at)
        self.entries[name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self.at, self.at + nbytes],
        }
        self.at += nbytes

    def finish(self) -> None:
        """The header, padded to its room, then the file flushed to the disk and closed."""
        try:
            header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
            assert len(header) <= self.room, (len(header), self.room)
            write_all(
                os.pwritev, self.fd, [struct.pack("<Q", self.room) + header + b" " * (self.room - len(header))], 0
            )
            os.fsync(self.fd)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class _Ring:
    """Host bytes for the tensors in flight, taken and given back in the same order: reused, so no
    tensor costs fresh pages (first touching them costs more than the copy into them)."""

    ALIGN = 64

    def __init__(self, capacity: int):
        self.buf = torch.empty(capacity, dtype=torch.uint8)
        self.spans: deque[tuple[int, int]] = deque()  # [start, end) of each span taken, oldest first
        self.head = 0  # where the next span starts, if it fits

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """``nbytes`` of the ring, or None until older spans are given back."""
        n = -(-nbytes // self.ALIGN) * self.ALIGN
        cap = self.buf.numel()
        if not self.spans:
            self.head = 0
        tail = self.spans[0][0] if self.spans else cap
        if self.spans and self.head > tail:  # free: [head, cap), then [0, tail)
            start = self.head if cap - self.head >= n else (0 if tail >= n else -1)
        else:  # free: [head, tail)
            start = self.head if tail - self.head >= n else -1
        if start < 0:
            return None
        self.spans.append((start, start + n))
        self.head = start + n
        return self.buf[start : start + nbytes]

    def give_back(self) -> None:
        self.spans.popleft()

    def holds(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr()


Alloc = Callable[[torch.Size, torch.dtype], torch.Tensor]


def _write_shards(
    source: Callable[[Alloc], Iterator[tuple[str, torch.Tensor]]],
    limit: int,
    work: str,
    room: int,
    progress: Progress,
    largest: int,
) -> tuple[list[list[str]], int]:
    """Write the tensors of ``source(alloc)`` in order into shards ``part-00000.safetensors``... of at
    most ``limit`` bytes of data (a larger tensor alone) under ``work``, each on one writer thread while
    the next are read, :data:`WINDOW` bytes in flight at most (NOTE [Shards written as they are read]);
    ``alloc(shape, dtype)`` gives the source reused memory (``largest``: the most bytes one takes).
    Returns each shard's names and the bytes written; the first error is raised once every write has
    ended and every file is closed."""
    pending: deque[tuple[Future[None], int, bool]] = deque()  # a write, its bytes, whether in the ring
    shards: list[_Shard] = []
    files: list[list[str]] = []
    in_flight = size = total = 0
    ring = _Ring(WINDOW + largest + _Ring.ALIGN)

    def land_oldest() -> None:
        nonlocal in_flight
        future, n, ringed = pending.popleft()
        future.result()
        in_flight -= n
        progress.advance(n)
        if ringed:
            ring.give_back()

    def alloc(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        while (got := ring.take(math.prod(shape) * dtype.itemsize)) is None and pending:
            land_oldest()
        return torch.empty(shape, dtype=dtype) if got is None else got.view(dtype).view(shape)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermem-save") as writer:
        try:
            for name, t in source(alloc):
                nbytes = t.numel() * t.element_size()
                if not files or (files[-1] and size + nbytes > limit):
                    if shards:
                        pending.append((writer.submit(shards[-1].finish), 0, False))
                    shards.append(_Shard(os.path.join(work, f"part-{len(shards):05d}.safetensors"), room))
                    files.append([])
                    size = 0
                pending.append((writer.submit(shards[-1].add, name, t), nbytes, ring.holds(t)))
                files[-1].append(name)
                in_flight, size, total = in_flight + nbytes, size + nbytes, total + nbytes
                while pending and in_flight > WINDOW:
                    land_oldest()
            if shards:
                pending.append((writer.submit(shards[-1].finish), 0, False))
            while pending:
                land_oldest()
        except BaseException:
            for future, _, _ in pending:
                future.cancel()
            for shard in shards:
                writer.submit(shard.close)  # after the write running now; the executor waits for them
            raise
    return files, total


def _adapter(module: torch.nn.Module) -> Optional[str]:
    """The active adapter of a peft model; None for any other module."""
    if type(module).__module__.split(".")[0] != "peft" or not hasattr(module, "peft_config"):
        return None
    active = getattr(module, "active_adapter", None)
    return active if isinstance(active, str) else None


def _save_adapter(reader: StateReader, module: torch.nn.Module, directory: str, dtype: Optional[torch.dtype]) -> None:
    """peft's ``adapter_model.safetensors`` and ``adapter_config.json`` of the active adapter, from
    the trained values alone (NOTE [Saving in the Hugging Face format])."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = _adapter(module)
    assert adapter is not None
    trained = {names[0]: value for names, value in reader.stream_weights(frozen=False)}
    if dtype is not None:
        trained = {k: v.to(dtype) if v.is_floating_point() else v for k, v in trained.items()}
    values = get_peft_model_state_dict(module, state_dict=trained, adapter_name=adapter)
    with _work_dir(directory) as work:
        save_file(
            {k: v.contiguous() for k, v in values.items()}, os.path.join(work, ADAPTER), metadata={"format": "pt"}
        )
        peft_model: Any = module  # peft is not typed here
        peft_model.peft_config[adapter].save_pretrained(work)
        _publish(work, directory, replaces_shards=False)


@contextlib.contextmanager
def _work_dir(directory: str) -> Iterator[str]:
    """A private directory beside ``directory`` to write a save into (our own leftover of a save
    killed in this process's pid removed first), removed whatever happens; an OSError inside is a
    ``tiermem:`` error saying that nothing in ``directory`` changed."""
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        raise ConfigError(f"tiermem: save_pretrained({directory!r}): {parent!r} does not exist; create it first")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"tiermem: save_pretrained({directory!r}): it is a file; pass a directory")
    work = os.path.join(parent, f".{os.path.basename(os.path.abspath(directory))}.tiermem-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, mode=0o700)
    try:
        yield work
    except OSError as e:
        raise StoreError(
            f"tiermem: save_pretrained({directory!r}) failed ({e}); nothing in {directory!r} changed: free space "
            f"or choose another directory, and save again"
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _final_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _save_config(module: torch.nn.Module, work: str) -> None:
    """A transformers model's config (and generation config) beside its weights."""
    for attr in ("config", "generation_config"):
        config = getattr(module, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(work)


def _publish(work: str, directory: str, *, replaces_shards: bool = True) -> None:
    """Move what ``work`` holds into ``directory``: a new directory is renamed into place; into an
    existing one the files are moved one by one, and (``replaces_shards``) an earlier save's shards
    and index removed."""
    if not os.path.exists(directory):
        os.rename(work, directory)
        return
    new = set(os.listdir(work))
    for name in sorted(new):
        os.replace(os.path.join(work, name), os.path.join(directory, name))
    for name in os.listdir(directory) if replaces_shards else ():  # the earlier save's files not replaced
        if name not in new and (name == INDEX or (name.startswith("model") and name.endswith(".safetensors"))):
            os.remove(os.path.join(directory, name))
