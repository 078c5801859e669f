"""The checks a torch.distributed.checkpoint directory passes before a load changes anything
(NOTE [Checkpoint directories]): its bytes against the manifests, DCP's metadata and the
``tiermem`` meta against the model, and every tensor's chunks covering it exactly once.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, TypeVar

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from tiermem.checkpoint import directory as disk
from tiermem.checkpoint.dcp_read import METADATA, read_metadata, read_record
from tiermem.checkpoint.footer import Invalid, check_meta
from tiermem.checkpoint.names import MASTER, params_of
from tiermem.checkpoint.opened import RECORD_CAP, OpenDir
from tiermem.checkpoint.shards import MANIFESTS, META, key
from tiermem.checkpoint.view import StateWriter
from tiermem.errors import StoreError, TierMemError
from tiermem.transfer.collectives import Group

log = logging.getLogger(__name__)
T = TypeVar("T")


def checked(writer: StateWriter, path: str) -> tuple[OpenDir, Metadata, dict]:
    """The directory ``path`` opened (NOTE [A load reads the files it checked]), DCP's metadata and
    the meta, once every rank's checks passed, in two rounds each ending in an agreement (NOTE
    [Checkpoint directories]): first the bytes (the manifests, ``.metadata`` on every rank, each
    rank's share of the data files), then what they hold (the metadata through the restricted
    unpickler, the meta record, every tensor against the model: NOTE [Nothing in a checkpoint
    runs]). On a failure every rank raises the first failing rank's error."""
    group = writer.core.group
    opened = agreed(group, lambda: OpenDir(path))
    try:
        files = agreed(group, lambda: _bytes(group, opened))
        if len({row[0] for row in group.exchange([int(files[METADATA][1][:15], 16)])}) != 1:
            raise StoreError(
                f"tiermem: the ranks found different checkpoints at {path!r} (a save published one while "
                f"they opened it, or they do not share the files); nothing was loaded. Load it again"
            )
        metadata, meta = agreed(group, lambda: _contents(writer, opened, files))
    except BaseException:
        opened.close()
        raise
    return opened, metadata, meta


def _bytes(group: Group, opened: OpenDir) -> disk.Files:
    """Every manifest, and the bytes this rank hashes: ``.metadata`` and its share of the data files."""
    files = disk.read_manifests(opened)
    if files is None:
        raise StoreError(
            f"tiermem: {opened.path!r} has no tiermem manifest (a user's own dcp.save writes none), so "
            f"its bytes cannot be checked and tm.load() refuses it; nothing was loaded. Save with "
            f"tm.save(), or load it with your own dcp.load into tm.sharded_state_dict() and then "
            f"tm.load_sharded_state_dict()"
        )
    if METADATA not in files:
        raise opened.bad(f"its manifests do not list {METADATA}")
    if files[METADATA][0] > RECORD_CAP:  # unpickled in memory: bounded before it is hashed
        raise opened.bad(
            f"its manifests give {METADATA} {files[METADATA][0]} bytes, more than it may hold ({RECORD_CAP})"
        )
    data = {n: v for n, v in files.items() if n != METADATA}
    disk.verify(opened, [METADATA, *disk.share(data, group.world, group.rank)], files)
    for name in data:
        opened.size(name)  # each opened now, as it was hashed: a publish from here on changes nothing read
    return files


def _contents(writer: StateWriter, opened: OpenDir, files: disk.Files) -> tuple[Metadata, dict]:
    """DCP's metadata and the meta, read as NOTE [Nothing in a checkpoint runs] says, and checked."""
    metadata = read_metadata(opened)
    tensors = dict(metadata.state_dict_metadata)
    unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - set(files))
    if unlisted:
        raise opened.bad(f"DCP's metadata points to {unlisted[:3]}, which no manifest lists")
    if not isinstance(tensors.get(META), BytesStorageMetadata):
        raise opened.bad(f"no {META!r} entry: not saved by tiermem")
    meta = parse_meta(read_record(opened, metadata, META), lambda why: opened.bad(f"its {META!r} entry {why}"))
    _match(writer, opened.path, meta, tensors)
    return metadata, meta


def agreed(group: Any, run: Callable[[], T]) -> T:
    """``run()``'s result on every rank, or on every rank the first failing rank's error."""
    result: Any = None
    error: TierMemError | None = None
    try:
        result = run()
    except TierMemError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - told to every rank before it is raised
        error = StoreError(f"tiermem: a checkpoint check failed ({type(e).__name__}: {e}); nothing was loaded")
        error.__cause__ = e
    shared = same_error(group, error)
    if shared is not None:
        if isinstance(result, OpenDir):
            result.close()
        raise shared
    return result


def same_error(group: Any, error: TierMemError | None) -> TierMemError | None:
    """The error of the lowest rank that has one (this rank's own object where that is this rank),
    on every rank; None where no rank has one. Two small all-gathers."""
    text = str(error).encode() if error is not None else b""
    kind = 0 if error is None else 1 if isinstance(error, StoreError) else 2
    rows = group.exchange([kind, len(text)])
    failed = [r for r, (k, _) in enumerate(rows) if k]
    if not failed:
        return None
    width = max(n for _, n in rows)
    texts = group.exchange(list(text.ljust(width, b"\0")))
    first = failed[0]
    if first == group.rank and error is not None:
        return error
    message = bytes(texts[first][: rows[first][1]]).decode(errors="replace")
    return (StoreError if rows[first][0] == 1 else TierMemError)(message)


def parse_meta(text: Any, bad: Callable[[str], TierMemError]) -> dict:
    """The ``tiermem`` entry's JSON, each field checked as the single file's footer is."""
    try:
        meta = json.loads(text)
        check_meta(meta)
    except (ValueError, TypeError, RecursionError):
        raise bad("is not tiermem's JSON") from None
    except Invalid as e:
        raise bad(f"is corrupt: {e}") from None
    return meta


def _match(writer: StateWriter, path: str, meta: dict, tensors: dict[str, Any]) -> None:
    """Every tensor the model needs is there, with its shape and an accepted dtype, its chunks
    covering it exactly; nothing else is; the meta fits the model."""

    def other(what: str) -> TierMemError:
        return TierMemError(
            f"tiermem: checkpoint {path!r} does not match this model: {what}; nothing was loaded. "
            f"Load it into the model it was saved from"
        )

    expected = {key(name): (shape, dtypes) for name, shape, dtypes in writer.specs(meta["precision"])}
    present = set(tensors) - {META, MANIFESTS}
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or unexpected:
        raise other(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, (shape, dtypes) in expected.items():
        md = tensors[name]
        if not isinstance(md, TensorStorageMetadata):
            raise other(f"{name!r} is not a tensor")
        if tuple(md.size) != shape:
            raise other(f"{name!r} has shape {tuple(md.size)}, the model has {shape}")
        if md.properties.dtype not in dtypes:
            held = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise other(f"{name!r} is {str(md.properties.dtype).removeprefix('torch.')}, the model holds it as {held}")
        why = coverage(shape, [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
        if why:
            raise StoreError(
                f"tiermem: checkpoint {path!r} is corrupt ({name!r}: {why}); nothing was loaded. Use another checkpoint"
            )
    meta_fits(writer, meta, other, f"checkpoint {path!r}")


def meta_fits(writer: StateWriter, meta: dict, other: Callable[[str], TierMemError], what: str) -> None:
    """The meta's step counts are of this model's trained parameters, its param groups this model's."""
    params = params_of((name for name, _, _ in writer.specs(meta["precision"])), MASTER)
    strangers = sorted(set(meta["param_step"]) - params)
    if strangers:
        raise other(f"meta.param_step counts steps of {strangers[:5]}, not trainable parameters of this model")
    writer.check_groups(meta["groups"], what)


def coverage(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """Why ``chunks`` (offsets, sizes) do not cover a tensor of ``shape`` exactly once; '' when they do."""
    numel = 1
    for n in shape:
        numel *= n
    total = 0
    for offsets, sizes in chunks:
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape))
        ):
            return f"a chunk at {offsets} of {sizes} lies outside its shape {shape}"
        volume = 1
        for s in sizes:
            volume *= s
        total += volume
    if total != numel:
        return f"its chunks hold {total} elements, the tensor {numel}"
    if not shape:
        return ""  # one element, held once
    boxes = sorted((o, s) for o, s in chunks if all(n > 0 for n in s))
    for i, (o1, s1) in enumerate(boxes):  # as many elements as the tensor: no two may overlap
        for o2, s2 in boxes[i + 1 :]:
            if o2[0] >= o1[0] + s1[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if all(a2 < a1 + n1 and a1 < a2 + n2 for a1, n1, a2, n2 in zip(o1, s1, o2, s2)):
                return f"chunks at {o1} and {o2} overlap"
    return ""
