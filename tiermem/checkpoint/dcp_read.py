"""Reading a DCP directory that passed its checksums without running anything it holds: DCP's
metadata through a restricted unpickler, the ``tiermem`` record as plain data, and the tensors
through the descriptors the load opened (NOTE [A load reads the files it checked]).

# NOTE [Nothing in a checkpoint runs]
torch's own ``dcp.load`` unpickles ``.metadata`` with ``pickle.load`` and every bytes entry with
``torch.load(weights_only=False)``: a crafted directory runs its code in the loading process.
Manifests do not stop that (their hash has no key: anyone can recompute it). So tiermem's load:

- unpickles ``.metadata`` with :class:`_Unpickler`, whose ``find_class`` admits only what a save
  writes there: DCP's metadata classes (``Metadata``, ``MetadataIndex``, ``StorageMeta``,
  ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``_MEM_FORMAT_ENCODING``), its filesystem's ``_StorageInfo``,
  ``torch.Size``, torch's dtypes, ``torch.serialization._get_layout`` (a layout by its name) and
  ``pathlib``'s ``PosixPath`` (the path the save was written to). Anything else (a payload's
  ``os.system``) is refused, before it is called, with a ``tiermem:`` error naming the file;
  persistent ids and out-of-band buffers too;
- checks what came out: a ``Metadata`` of DCP's entry types, every storage item in a file named by
  a bare name (no ``/``, no ``..``; opened without following a symlink), with no transform;
- reads the ``tiermem`` record itself (its place from the metadata, inside its file and under a
  cap) with ``torch.load(weights_only=True)``, and takes only a str (JSON, parsed and checked);
- reads tensors as DCP does (``torch.load(weights_only=True)`` of each item) but through the
  load's descriptors, and refuses to read any bytes entry.

All of it only after every rank agreed that every byte matches its manifest (NOTE [Checkpoint
directories]); what a manifest-less directory holds is never read: such a directory is refused.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiermem.checkpoint.opened import RECORD_CAP, OpenDir
from tiermem.errors import StoreError

METADATA = ".metadata"

_DCP = "torch.distributed.checkpoint.metadata"
_ADMITTED = {
    *(
        (_DCP, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),  # Python 3.13's home of the class
    ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _Refused(Exception):
    pass


class _Unpickler(pickle.Unpickler):
    """An unpickler that constructs DCP's metadata and nothing else (NOTE [Nothing in a checkpoint runs])."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ADMITTED or dtype:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def refused(opened: OpenDir, name: str, what: str) -> StoreError:
    return StoreError(
        f"tiermem: checkpoint {opened.path!r} is refused: its {name!r} would run {what} when loaded (as "
        f"torch's dcp.load would); nothing was loaded and nothing of it ran. Load only checkpoints "
        f"written by tm.save()"
    )


def read_metadata(opened: OpenDir) -> Metadata:
    """DCP's metadata of the opened directory, unpickled with :class:`_Unpickler` and checked."""
    data = opened.read(METADATA, cap=RECORD_CAP)
    try:
        md = _Unpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise refused(opened, METADATA, str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises
        raise opened.bad(f"its {METADATA!r} is not DCP's metadata ({type(e).__name__}: {e})") from None
    why = _shape_of(md)
    if why:
        raise opened.bad(f"its {METADATA!r} {why}")
    return md


def _shape_of(md: Any) -> str:
    """Why ``md`` is not DCP metadata whose items all lie in the directory's own files; '' if it is."""
    if not isinstance(md, Metadata):
        return f"holds a {type(md).__name__}, not DCP's Metadata"
    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "has no entries"
    for fqn, entry in entries.items():
        if not isinstance(fqn, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"has an entry {fqn!r} of another kind"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return f"has a storage item {index!r} of another kind"
        path, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(path, str) or "/" in path or "\\" in path or path in ("", ".", ".."):
            return f"points to {path!r}, outside the checkpoint directory"
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            return f"places {index.fqn!r} at [{offset!r}, +{length!r})"
        if info.transform_descriptors:
            return f"transforms {index.fqn!r} ({list(info.transform_descriptors)[:3]}), which tm.save never does"
    return ""


def read_record(opened: OpenDir, md: Metadata, fqn: str) -> Any:
    """The bytes entry ``fqn`` (a str tm.save wrote), read as plain data."""
    info = md.storage_data.get(MetadataIndex(fqn))
    if info is None:
        raise opened.bad(f"its metadata does not place {fqn!r}")
    data = opened.read(info.relative_path, info.offset, info.length, cap=RECORD_CAP)
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(opened, info.relative_path, f"what its {fqn!r} record holds ({e})") from None
    except Exception as e:  # noqa: BLE001 - whatever damaged bytes raise
        raise opened.bad(f"its {fqn!r} record is unreadable ({type(e).__name__})") from None
    return value


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if (o, n) != (0, t.shape[dim]):
            t = t.narrow(dim, o, n)
    return t


class Reader(StorageReader):
    """DCP's storage reader over the opened directory and its checked metadata: every item read
    through the load's descriptors, tensors only (NOTE [Nothing in a checkpoint runs])."""

    def __init__(self, opened: OpenDir, metadata: Metadata):
        super().__init__()
        self.opened, self.metadata = opened, metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            info = self.metadata.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                raise refused(self.opened, info.relative_path, f"the bytes entry {item.storage_index.fqn!r}")
            with self.opened.view(info.relative_path, info.offset, info.length) as stream:
                tensor = torch.load(stream, map_location="cpu", weights_only=True)
            if not isinstance(tensor, torch.Tensor):
                raise self.opened.bad(f"its {item.storage_index.fqn!r} is not a tensor")
            tensor = _narrow(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise self.opened.bad(f"its {item.storage_index.fqn!r} holds {tuple(tensor.shape)}")
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
