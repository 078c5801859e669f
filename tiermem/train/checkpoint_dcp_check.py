"""The checks a torch.distributed.checkpoint directory passes before a load changes anything
(NOTE [Checkpoint directories]): its bytes against the manifests, DCP's metadata and the
``tiermem`` meta against the model, and every tensor's chunks covering it exactly once.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tiermem.errors import StoreError, TierMemError
from tiermem.train import checkpoint_dir as disk
from tiermem.train.checkpoint_footer import Invalid, check_meta
from tiermem.train.checkpoint_shards import MANIFESTS, META, key
from tiermem.train.state import ModelState

log = logging.getLogger(__name__)


def checked(state: ModelState, path: str, read_metadata: Callable[[], Any], read_meta: Callable[[], Any]) -> dict:
    """The meta of the checkpoint directory ``path``, once everything this rank checks passed:
    its manifests and checksums (this rank's share of the data files), DCP's metadata (read by
    ``read_metadata`` only after its checksum passed), the meta (``read_meta``: the ``tiermem``
    entry's string) and every tensor against the model. Raises the first failure."""

    def bad(why: str) -> StoreError:
        return StoreError(
            f"tiermem: {path!r} is not a readable tiermem checkpoint ({why}); nothing was loaded. "
            f"Pass a directory written by tm.save() or by dcp.save(tm.sharded_state_dict())"
        )

    try:
        files = disk.read_manifests(path)
    except OSError as e:
        raise bad(e.strerror or str(e)) from None
    if files is None:
        if state.writes_files:  # one line, not one a rank
            log.warning(
                "tiermem: %s has no tiermem manifest (written by dcp.save, not tm.save): its bytes are not "
                "checksummed; names, shapes, dtypes and coverage are checked against the model",
                path,
            )
    else:
        if disk.METADATA not in files:
            raise bad(f"its manifests do not list {disk.METADATA}")
        disk.verify(path, [disk.METADATA], files)  # before DCP unpickles it
    try:
        metadata = read_metadata()
        storage = metadata.storage_data
        tensors = dict(metadata.state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - a missing or unreadable .metadata, whatever DCP raises for it
        raise bad(f"no DCP metadata: {type(e).__name__}: {e}") from None
    if files is None and MANIFESTS in tensors:
        raise bad("tm.save wrote it with manifests, which are missing now: its bytes cannot be checked")
    if files is not None:
        unlisted = sorted({getattr(info, "relative_path", "?") for info in storage.values()} - set(files))
        if unlisted:
            raise bad(f"DCP's metadata points to {unlisted[:3]}, which no manifest lists")
        data = {n: v for n, v in files.items() if n != disk.METADATA}
        disk.verify(path, disk.share(data, state.group.world, state.group.rank), files)
    if not isinstance(tensors.get(META), BytesStorageMetadata):
        raise bad(f"no {META!r} entry: not saved by tiermem")
    meta = parse_meta(read_meta(), lambda why: bad(f"its {META!r} entry {why}"))
    _match(state, path, meta, tensors)
    return meta


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


def _match(state: ModelState, path: str, meta: dict, tensors: dict[str, Any]) -> None:
    """Every tensor the model needs is there, with its shape and an accepted dtype, its chunks
    covering it exactly; nothing else is; the meta fits the model."""

    def other(what: str) -> TierMemError:
        return TierMemError(
            f"tiermem: checkpoint {path!r} does not match this model: {what}; nothing was loaded. "
            f"Load it into the model it was saved from"
        )

    expected = {key(name): (shape, dtypes) for name, shape, dtypes in state.specs(meta["precision"])}
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
    meta_fits(state, meta, other, f"checkpoint {path!r}")


def meta_fits(state: ModelState, meta: dict, other: Callable[[str], TierMemError], what: str) -> None:
    params = {name.partition("/")[2] for name, _, _ in state.specs(meta["precision"]) if name.startswith("master/")}
    strangers = sorted(set(meta["param_step"]) - params)
    if strangers:
        raise other(f"meta.param_step counts steps of {strangers[:5]}, not trainable parameters of this model")
    state.check_groups(meta["groups"], what)


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
