"""What a load writes into a TieredModel: :class:`StateWriter`. It tells what a checkpoint must
hold for this model (names, shapes, dtypes, param groups) so that a load checks everything before
it changes anything, then takes the tensors in by checkpoint name (:class:`tiermem.checkpoint.names.StateName`)
through the homes (NOTE [Homes]), sends the weights home and takes the step counts, loss scale and
hyperparameters; and it takes in what user code wrote into the weights (``tm.resident(...)``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch

from tiermem.checkpoint.names import BUFFERS, FROZEN, StateName
from tiermem.checkpoint.view.core import HYPER, Piece, StateCore
from tiermem.config.specs import PRECISIONS
from tiermem.errors import TierMemError

log = logging.getLogger(__name__)

Spec = tuple[str, tuple[int, ...], tuple[torch.dtype, ...]]  # name, shape, the dtypes accepted


class StateWriter:
    """The model's state written in, by checkpoint name, once the caller checked the checkpoint
    against :meth:`specs` and :meth:`check_groups`."""

    def __init__(self, core: StateCore):
        self.core = core

    def release(self) -> None:
        """Done writing buckets: whole-bucket buffers kept for that go."""
        self.core.release_views()

    # -- what a checkpoint must hold -----------------------------------------------------------------
    def specs(self, precision: str) -> Iterator[Spec]:
        """The name, shape and the dtypes accepted of every tensor a checkpoint saved at
        ``precision`` may hold for this model, reading none. Optimizer state is in its format's
        dtypes and frozen parameters keep their dtype, whatever the precision; a buffer may be in its dtype as the
        module gave it or, floating-point, in the working dtype of ``precision`` (as this version
        writes it): loading converts either (``t.copy_``), and nothing else is taken."""
        layout = self.core.layout
        for b in layout.buckets:
            for part in b.state.parts:
                for s in b.slots:
                    shape = tuple(s.shape) if part.elementwise else (part.numel(s.numel, s.shape),)
                    yield str(StateName(part.name, s.name)), shape, (part.dtype,)
        for n in layout.frozen:
            shape, dtype = layout.frozen.meta(n)
            yield str(StateName(FROZEN, n)), shape, (dtype,)
        given = layout.buffer_dtypes
        for n, t in self.core.module.named_buffers():
            dtypes: tuple[torch.dtype, ...] = (given.get(n, t.dtype),)
            if t.is_floating_point():
                dtypes += (PRECISIONS[precision],)
            yield str(StateName(BUFFERS, n)), tuple(t.shape), dtypes

    def check_groups(self, saved: list[dict], what: str) -> None:
        """A checkpoint's param groups (``saved``, its meta's) are this model's: as many, and
        (written by a version that records them: MEMBERS) the same names with the same
        parameters, in the same order; else a ``tiermem:`` error naming ``what``."""
        ours_all = self.core.param_groups
        fix = "build the same param groups (the optimizer's, and tm.optimizer.add_param_group) before loading"
        if len(saved) != len(ours_all):
            raise TierMemError(
                f"tiermem: {what} has {len(saved)} param groups, this model {len(ours_all)}; nothing was loaded: {fix}"
            )
        for i, (theirs, ours) in enumerate(zip(saved, ours_all)):
            if "name" not in theirs:
                continue  # written before groups were recorded: matched by their number
            extra = sorted(set(theirs.get("params", ())) - set(ours["param_names"]))
            lacking = sorted(set(ours["param_names"]) - set(theirs.get("params", ())))
            if theirs["name"] != ours["name"] or extra or lacking:
                raise TierMemError(
                    f"tiermem: {what} has other param groups than this model: group {i} is "
                    f"{theirs['name']!r} there, {ours['name']!r} here (only there: {extra[:3]}, only "
                    f"here: {lacking[:3]}); nothing was loaded: {fix}"
                )

    # NOTE [A failed load is guarded]
    # A load checks everything before it changes anything, but a read can still fail part way
    # (an I/O error, a file that changed after its checksum passed): some buckets then hold the
    # checkpoint's state and the rest the run's. :meth:`updating` records the failure, and until a
    # load succeeds a forward, ``tm.step()``, ``tm.save()`` and ``tm.sharded_state_dict()`` raise a
    # ``tiermem:`` error naming it, as after a step that failed part way (NOTE [A failed step is
    # rolled forward]). Under data parallelism every rank learns of the failure after the last
    # bucket (the buckets' collectives kept in step) and raises the same error.
    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """The weights are about to be replaced (a checkpoint load): cached copies are stale. If
        the load raises part way, the model holds some of the state and not the rest: it refuses
        to compute until a load succeeds (NOTE [A failed load is guarded],
        :meth:`StateCore.check_loaded`)."""
        homes = self.core.layout.homes
        homes.begin_update()
        self.core.loads += 1
        try:
            yield
        except BaseException as e:
            self.core.failed_load = f"{type(e).__name__}: {e}"
            raise
        self.core.failed_load = None
        for home in homes.weight_homes():
            home.end_update()

    # -- the whole state, through a reader by name (the single file) -----------------------------------
    def load(self, read_into: Callable[[str, torch.Tensor], None], meta: dict) -> None:
        """Fill every tensor through ``read_into(name, target)`` (the caller has validated the
        whole checkpoint first), send the weights home, then take the step counts, loss scale
        (only from a checkpoint of this precision) and hyperparameters from ``meta``."""
        layout = self.core.layout
        homes = layout.homes
        with self.updating():
            for b in layout.buckets:
                views = homes.state[b.index].load_views(b)
                for i, part in enumerate(b.state.parts):
                    for j, s in enumerate(b.slots):
                        read_into(str(StateName(part.name, s.name)), b.pieces(views, j)[i])
                homes.state[b.index].store(b, views)
                homes.weights[b.index].load(b, views[0], homes.compute_tier(b))
            self.release()
            frozen = layout.frozen
            for name in frozen:  # one at a time: a working copy off the device is read from no further
                t = frozen.target(name)
                read_into(str(StateName(FROZEN, name)), t)
                frozen.write(name, t)
            for name, t in self.core.module.named_buffers():
                read_into(str(StateName(BUFFERS, name)), t)
        self.take_meta(meta)

    def take_meta(self, meta: dict) -> None:
        """The step counts, loss scale (only from a checkpoint of this precision) and
        hyperparameters of a validated checkpoint's ``meta``."""
        core = self.core
        for group, saved in zip(core.param_groups, meta["groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in HYPER})
        if meta["precision"] == core.precision:
            core.scaler.load_state_dict(meta["scaler"])
        else:  # another precision's scale means nothing here (fp32's 1.0 would defeat fp16's scaling)
            log.info(
                "tiermem: a %s checkpoint loaded at %s: the loss scale stays %s",
                meta["precision"],
                core.precision,
                core.scaler.scale,
            )
        core.stepper.load_param_steps({k: int(v) for k, v in meta["param_step"].items()}, meta["step"])

    # -- this process's part of the state (a sharded checkpoint) ----------------------------------------
    def load_local(self, index: int, fill: Callable[[tuple[torch.Tensor, ...]], None]) -> None:
        """Replace this process's part of bucket ``index``'s state with what ``fill(views)`` writes
        into ``views`` (zeros elsewhere), then send the bucket's weights home (under data
        parallelism a collective: every rank calls it for every bucket, in order)."""
        b = self.core.bucket(index)
        homes = self.core.layout.homes
        home = homes.state[index]
        views = home.local_views(b)
        fill(views)
        home.store_local(b, views)
        homes.weights[index].load(b, home.whole_master(b, views[0]), homes.compute_tier(b))

    def load_frozen(self, index: int, pieces: list[Piece], fill: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Replace this process's ``pieces`` of frozen bucket ``index`` (:meth:`StateCore.frozen_pieces`
        gives them) with what ``fill(targets)`` writes into ``targets``: by parameter name, a flat tensor of
        its piece's ``hi - lo`` elements in the dtype a checkpoint holds it in (its own:
        :meth:`StateCore.frozen_dtype`). A piece of a parameter whose value is its working copy
        is a view of a host copy of the chunk; one of a parameter that keeps a copy in its own
        dtype becomes this rank's piece of that copy, and its chunk's elements rounded from it.
        No communication."""
        frozen = self.core.layout.frozen
        chunk, release = frozen.read_local(index)
        try:
            chunk = chunk.to("cpu", copy=True)
        finally:
            release()
        targets = {
            p.name: torch.empty(p.hi - p.lo, dtype=self.core.frozen_dtype(p.name))
            if frozen.keeps_copy(p.name)
            else chunk[p.at : p.at + p.hi - p.lo]
            for p in pieces
        }
        fill(targets)
        for p in pieces:
            if frozen.keeps_copy(p.name):
                frozen.write_copy(p.name, targets[p.name])
                chunk[p.at : p.at + p.hi - p.lo].copy_(targets[p.name])  # as :meth:`FrozenParams.write` rounds
        frozen.write_local(index, chunk)

    def rest(self, *, pieces: bool = False) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds besides the optimizer state, by name (``frozen/<param>``,
        ``buffers/<buffer>``), as tensors to fill in place (a frozen working copy off the device is
        not read), then :meth:`commit_rest` with them. With ``pieces``, the frozen parameters
        sharded over the ranks are left out: the caller writes them as :meth:`load_frozen`."""
        frozen = self.core.layout.frozen
        out = {str(StateName(FROZEN, n)): frozen.target(n) for n in self.core.whole_frozen(pieces=pieces)}
        out.update((str(StateName(BUFFERS, name)), t) for name, t in self.core.module.named_buffers())
        return out

    def commit_rest(self, rest: dict[str, torch.Tensor]) -> None:
        """Frozen parameters take the values filled into ``rest`` (:meth:`rest`), at their home."""
        frozen = self.core.layout.frozen
        for name in frozen:
            key = str(StateName(FROZEN, name))
            if key in rest:  # else loaded as pieces (:meth:`load_frozen`)
                frozen.write(name, rest[key])

    # -- what user code wrote into the weights -------------------------------------------------------
    def take_weights(self, values: dict[str, torch.Tensor]) -> None:
        """User code wrote into weights (``tm.resident(...)``): name -> the working-precision value
        now. Each element that differs from its fp32 master rounded to the working precision (what
        it held before) becomes the master (or the frozen parameter's fp32 copy); the others keep
        their fp32 value."""
        layout = self.core.layout
        slots = {s.name: (b, s) for b in layout.buckets for s in b.slots}
        by_bucket: dict[int, list] = {}
        for name, value in values.items():
            if name in slots:
                b, s = slots[name]
                by_bucket.setdefault(b.index, [b]).append((s, value))
            elif layout.frozen.keeps_copy(name):  # else the working copy is its value: already home
                copy, lo, hi = layout.frozen.copy_piece(name)  # this rank's elements: nothing gathered
                if _take(copy, value.reshape(-1)[lo:hi]):
                    layout.frozen.write_copy(name, copy)
        homes = layout.homes
        try:
            for b, *entries in by_bucket.values():
                views = homes.state[b.index].read(b)
                if any([_take(views[0][s.offset : s.offset + s.numel].view(s.shape), value) for s, value in entries]):
                    homes.state[b.index].store(b, views)
        finally:
            self.release()


def _take(master: torch.Tensor, value: torch.Tensor) -> bool:
    """Copy into ``master`` the elements of ``value`` that differ from ``master`` in ``value``'s
    dtype; whether any did."""
    value = value.detach().to(master.device)
    changed = value != master.to(value.dtype)
    if not changed.any():
        return False
    master[changed] = value[changed].to(master.dtype)
    return True
