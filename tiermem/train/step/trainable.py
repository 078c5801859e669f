"""Parameters whose ``requires_grad`` changes during training: frozen or unfrozen between steps.

# NOTE [Freezing and unfreezing]
What a parameter trains is read from its ``requires_grad`` when a step's training starts: at a
training forward (``tm(...)`` with grad enabled and the module in train mode), at each
``tm.backward()`` and before ``tm.load()``. As with ``torch.optim``:

- Freezing a parameter that has optimizer state stops its updates: it gets no gradient, so the
  step skips it (as torch skips a parameter whose ``.grad`` is None); its state, bucket and homes
  stay, and unfreezing it later continues from that state. Nothing moves. (Its bucket's grads
  leave for their home when backward ends rather than as soon as the bucket is complete.)
- Unfreezing a parameter frozen when the model was built (which has no state, only a working copy
  and an fp32 copy on the host: NOTE [Homes]) gives it what a trainable one has: buckets appended
  after the model's (:func:`tiermem.plan.buckets.plan_buckets`), placed by the model's policy and
  homed by :func:`tiermem.train.layout.make_homes` like any other (grads, state, working weights),
  its fp32 master from its fp32 copy, its moments zero and its step count 0, its grads collected
  from the next backward; its frozen copies are given back. It joins the param group of
  ``tm.optimizer`` that lists it (NOTE [Param groups]).

Everything is checked before anything is allocated, and a check that fails raises a ``tiermem:``
error at that forward or backward, leaving the model as it was (so the next call raises it again
until the change is undone or made possible): the group that lists the parameter, the rules a
placement must follow (tiermem.plan.placement), and the bytes the new buckets need
(:func:`tiermem.plan.footprint.footprint`, the constructor's rule, less the off-device weights they
reuse) against what each tier's budget has left; an unfreeze that does not fit is refused with
those figures. Unfreezing waits for the step boundary: found while earlier micro-batches' grads
wait for a step, it is an error (freezing is not: a parameter that gets no more gradients in a
step is updated with those it got, as in torch).

Under data parallelism every rank must train the same parameters: each ``tm.backward()`` compares
a fingerprint of the ranks' trainable sets first (one all-reduce of two numbers), and a difference
is an error on every rank. Unfreezing a parameter frozen at construction is refused there in this
version (the new buckets' sharded homes would have to join the collectives' order): build the
model with the parameter trainable and freeze it before the first step; a frozen parameter with
state unfreezes under any world size.

# NOTE [The parameters a model was wrapped with]
A TieredModel trains the parameter objects its module had when it was wrapped: each has its
buckets, homes and hooks. One added later (a module attached, ``model.extra = nn.Linear(...)``, or
a parameter replaced or deleted) has none of them: it would compute in another dtype, get no
update, and be missing from every name-keyed read. Every forward and step compares the module's
parameters with those (by object and name, ~0.1 ms per 1000 parameters) and refuses with an
error that says to wrap the finished model; ``detach()`` checks first and changes nothing when
a wrapped parameter is gone, and gives parameters added later back as they are (said in the
log), so detach-and-wrap-again works.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import xxhash

from tiermem.config.specs import _Spec
from tiermem.errors import ConfigError, TierMemError
from tiermem.plan.buckets import Bucket
from tiermem.plan.footprint import check_fits
from tiermem.plan.model_plan import plan_unfrozen
from tiermem.plan.policy import Policy
from tiermem.train.homes.uploads import Outputs
from tiermem.train.hooks import HookSet
from tiermem.train.layout import Layout, fill_homes, make_homes
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.groups import check_listed
from tiermem.train.step.in_backward import WindowGrads
from tiermem.train.weights.frozen import copy_key
from tiermem.train.weights.param_offload import ParamOffload
from tiermem.transfer.collectives import Group
from tiermem.transfer.service import CopyService
from tiermem.types import Tier

log = logging.getLogger(__name__)


class Trainable:
    """Keeps a model's buckets in step with its parameters' ``requires_grad`` (NOTE [Freezing and
    unfreezing]). Built by the TieredModel with the collaborators an unfreeze extends."""

    def __init__(
        self,
        module: torch.nn.Module,
        layout: Layout,
        *,
        policy: Policy,
        dtype: torch.dtype,
        bucket_numel: int,
        overlap: bool,
        group: Group,
        stores: dict,
        engine: CopyService,
        weights_off_device: Optional[ParamOffload],
        grads: GradCollector,
        outputs: Outputs,
        hooks: HookSet,
        param_groups: list[dict],
        settle: Callable[[], None],
        on_device_cuda: bool,
        spec: _Spec,
        window: Optional[WindowGrads] = None,
    ):
        """``settle``: lands an update still running in the background (overlap_step) before the
        layout changes; ``window``: the GRAD home under update_in_backward, which homes the grads
        of parameters unfrozen too."""
        self.layout, self.policy, self.dtype, self.bucket_numel = layout, policy, dtype, bucket_numel
        self.overlap, self.group, self.stores, self.engine = overlap, group, stores, engine
        self.off_device, self.grads, self.outputs, self.hooks = weights_off_device, grads, outputs, hooks
        self.param_groups, self.settle, self.nvme_staging = param_groups, settle, on_device_cuda
        self.spec = spec  # the optimizer: the state format of a parameter unfrozen
        self.window = window
        self._module = module
        self._params = list(module.named_parameters())  # each parameter once, by its first name
        self._flags = self._read()  # requires_grad of each, as last taken
        self.changes = 0  # times the trainable set changed (a state dict taken before one is of another model)
        self._trained = self._names(self._flags)

    def _read(self) -> list[bool]:
        return [p.requires_grad for _, p in self._params]  # per call: ~0.1 ms per 1000 parameters

    def _names(self, flags: list[bool]) -> frozenset[str]:
        return frozenset(n for (n, _), f in zip(self._params, flags) if f)

    # -- the parameters the model was wrapped with (NOTE [The parameters a model was wrapped with]) --
    @property
    def wrapped(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Each parameter the model was wrapped with, once, by its first name."""
        return list(self._params)

    def changed(self) -> tuple[list[str], list[str]]:
        """The module's parameters it was not wrapped with, and those it was wrapped with that it no
        longer has under their name (replaced or deleted): two lists of names."""
        now = list(self._module.named_parameters())
        if len(now) == len(self._params) and all(n == m and p is q for (n, p), (m, q) in zip(now, self._params)):
            return [], []
        had = {id(p) for _, p in self._params}
        has = {n: p for n, p in now}
        added = [n for n, p in now if id(p) not in had]
        gone = [n for n, p in self._params if has.get(n) is not p]
        return added, gone

    def check_unchanged(self, call: str) -> None:
        """Refuse ``call`` when the module's parameters are not those it was wrapped with."""
        added, gone = self.changed()
        if added or gone:
            raise ConfigError(
                f"tiermem: {call}: the module's parameters changed after it was wrapped ("
                f"{_changes(added, gone)}); a TieredModel trains the parameters its module had when it "
                f"was built: attach every module before TieredModel(model, ...), or call tm.detach() "
                f"and wrap the module again"
            )

    def detachable(self) -> None:
        """Before ``detach()`` changes anything: refused when a wrapped parameter is gone (its
        trained weights would have nowhere to go); parameters added later are said and left as they are."""
        added, gone = self.changed()
        if gone:
            raise ConfigError(
                f"tiermem: detach(): the module no longer has parameters it was wrapped with "
                f"({_changes([], gone)}), so their trained weights have nowhere to go; nothing was changed: "
                f"put them back and call detach() again (tm.state_dict() reads the weights meanwhile)"
            )
        if added:
            log.warning(
                "tiermem: detach(): %s were added to the module after it was wrapped; tiermem never trained "
                "them, and gives them back as they are",
                _changes(added, []).removeprefix("added: "),
            )

    # -- the checks at a step's forward, backward and load ------------------------------------------
    def sync(self, *, grads_waiting: bool, collective: bool) -> None:
        """Take any change of ``requires_grad`` since the last call (NOTE [Freezing and
        unfreezing]). ``collective``: the ranks compare their trainable sets first (every rank
        makes this call at the same point: a backward or a load)."""
        flags = self._read()
        if collective and self.group.world > 1:
            self._same_on_every_rank(self._names(flags))
        if flags == self._flags:
            return
        now = self._names(flags)
        new = [(n, p) for n, p in self._params if n in now and n in self.layout.frozen]
        if new:
            self._unfreeze(new, grads_waiting)
        frozen = sorted(self._trained - now)
        if frozen:
            log.info(
                "tiermem: %d parameters were frozen; their optimizer state is kept, and they train again when "
                "unfrozen: %s",
                len(frozen),
                ", ".join(frozen[:5]),
            )
        self._flags, self._trained = flags, now
        self.changes += 1

    def _same_on_every_rank(self, now: frozenset[str]) -> None:
        """The trainable set and the param groups' membership alike on every rank, or an error on all."""
        text = "\0".join(sorted(now)) + "\1" + "\1".join("\0".join(g["param_names"]) for g in self.param_groups)
        h = float(xxhash.xxh3_64_intdigest(text.encode()) >> 12)  # 52 bits: exact in a double
        both = self.group.max_(torch.tensor([h, -h], dtype=torch.float64))
        if both[0].item() != -both[1].item():
            raise TierMemError(
                "tiermem: the ranks train different parameters (requires_grad, or the param groups "
                "of tm.optimizer, differ between them); freeze, unfreeze and add_param_group alike on "
                "every rank, at the same step"
            )

    # -- unfreezing -----------------------------------------------------------------------------------
    def _unfreeze(self, new: list[tuple[str, torch.nn.Parameter]], grads_waiting: bool) -> None:
        names = [n for n, _ in new]
        shown = f"{names[:5]}{' and more' if len(names) > 5 else ''}"
        if grads_waiting:
            raise TierMemError(
                f"tiermem: {shown} were unfrozen while gradients of earlier micro-batches wait for "
                f"tm.step(); unfreeze between steps (after tm.step(), before the next forward), or "
                f"freeze them again"
            )
        if self.group.world > 1:
            raise ConfigError(
                f"tiermem: {shown} were frozen when the TieredModel was built and are unfrozen now; "
                f"under data parallelism this version cannot add them to the sharded buckets: build "
                f"the model with them trainable and freeze them (requires_grad_(False)) before the "
                f"first step, then unfreeze them when their turn comes"
            )
        self._unfreeze_checked(self._planned(new), names)

    def _planned(self, new: list[tuple[str, torch.nn.Parameter]]) -> list[Bucket]:
        """The new parameters' buckets (planned by :func:`tiermem.plan.model_plan.plan_unfrozen`),
        after every check that needs no allocation."""
        buckets, need = plan_unfrozen(
            new,
            self.policy,
            self.spec,
            self.dtype,
            self.bucket_numel,
            group_of=check_listed(self.param_groups, [n for n, _ in new]),
            weight_homes=self.off_device.homes if self.off_device is not None else {},
            after=self.layout.buckets,
            overlap=self.overlap,
            nvme_staging=self.nvme_staging,
        )
        shown = ", ".join(s.name for b in buckets for s in b.slots[:3])
        check_fits(need, self.stores, what=f"<unfreezing {shown}>")
        return buckets

    def _unfreeze_checked(self, buckets: list[Bucket], names: list[str]) -> None:
        """Allocate and fill the new buckets' homes, then hand them to the model's collaborators."""
        self.settle()  # overlap_step: the update in flight reads the homes this extends
        before = {tier: set(store.keys()) for tier, store in self.stores.items() if tier != Tier.NVME}
        try:
            homes, step_buckets = make_homes(
                buckets,
                self.stores,
                self.engine,
                self.dtype,
                overlap=self.overlap,
                weights_off_device=self.off_device,
                group=self.group,
                window=self.window,
            )
            frozen = self.layout.frozen
            fill_homes(
                homes, buckets, lambda s, at, out: out.copy_(frozen.value(s.name).reshape(-1)[at : at + out.numel()])
            )
            for home in homes.state_homes():
                home.release_views()
        except BaseException:
            for tier, keys in before.items():  # what the new homes took goes back (the model is as it was)
                for key in set(self.stores[tier].keys()) - keys:
                    self.stores[tier].delete(key)
            raise
        self.layout.grow(buckets, step_buckets, homes)  # its Homes are the outputs', the collector's, the step's
        self.outputs.add(step_buckets)
        self.grads.add([s for b in buckets for s in b.slots])
        for b in buckets:
            for s in b.slots:
                for store in self.stores.values():  # its copy (host or NVMe); on the device its working copy
                    store.delete(copy_key(s.name))
                self.hooks.add(s.param.register_post_accumulate_grad_hook(self.grads.on_grad))
                self._show_master(b, s, homes)
        log.info(
            "tiermem: %d parameters were unfrozen (%s, %s elements): their optimizer state is created and "
            "they train from this step, in %d new buckets",
            len(names),
            ", ".join(names[:5]),
            f"{sum(b.numel for b in buckets):,}",
            len(buckets),
        )

    def _show_master(self, b: Bucket, s: Any, homes: Any) -> None:
        """``tm.optimizer``'s group shows the parameter's fp32 master now, not its frozen copy."""
        for g in self.param_groups:
            if s.name in g["param_names"]:
                g["params"][g["param_names"].index(s.name)] = homes.state[b.index].master(b, s)


def _changes(added: list[str], gone: list[str]) -> str:
    """What :meth:`Trainable.changed` found, in words, five names of each at most."""
    said = [
        f"{what}: {', '.join(names[:5])}{' and more' if len(names) > 5 else ''}"
        for what, names in (("added", added), ("replaced or deleted", gone))
        if names
    ]
    return "; ".join(said)
