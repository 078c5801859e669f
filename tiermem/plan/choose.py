"""The planner's judge of candidate placements (NOTE [Choosing a placement] in tiermem/plan/policy.py).

:class:`Evaluator` plans the buckets a candidate policy gives a model with the same functions
TieredModel's constructor calls (:func:`tiermem.plan.placement.plan`,
:func:`tiermem.plan.footprint.footprint`), checks them against the tiers' limits as the constructor
checks its stores, and predicts a step's seconds per stage (:mod:`tiermem.plan.cost`). Nothing is
allocated: the module may live on the meta device.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from tiermem.errors import ConfigError
from tiermem.plan.cost import Rates, predict
from tiermem.plan.footprint import footprint, largest_module_bytes, totals
from tiermem.plan.placement import bind, compute_tier, plan
from tiermem.plan.policy import Evaluation, Policy
from tiermem.plan.profile import Profile, load_profile
from tiermem.types import Tier


class Evaluator:
    """``evaluator(policy, profile=None, forward_backward=0.0) -> Evaluation`` for one model and
    configuration. ``limits``: the bytes each tier's store may hold (a tier without a store is
    absent); ``machine``: returns this machine's profile (called once, when first needed)."""

    def __init__(self, module: torch.nn.Module, spec: Any, dtype: torch.dtype, bucket_numel: int, *,
                 limits: Mapping[Tier, int], machine: Callable[[], Profile], overlap: bool = False, world: int = 1):
        self.module, self.spec, self.dtype, self.bucket_numel = module, spec, dtype, bucket_numel
        self.limits, self.overlap, self.world = dict(limits), overlap, world
        self._machine = machine
        self._rates: Optional[Rates] = None
        self._asked: Any = None  # the last profile a policy passed in, for :meth:`predict`

    def rates(self, profile: Any = None) -> Rates:
        """The rates of ``profile`` (a Profile or its data), or of this machine's when None."""
        if profile is not None:
            return Rates.from_profile(profile if isinstance(profile, Profile) else Profile(profile))
        if self._rates is None:
            self._rates = Rates.from_profile(self._machine())
        return self._rates

    def predict(self, policy: Policy, forward_backward: float) -> Optional[dict[str, float]]:
        """Predicted seconds per stage of ``policy``'s step with the measured ``forward_backward``,
        from the profile the placement was chosen with (or a saved one); None when there is none
        (nothing is measured for it) or it lacks a figure the cost model needs."""
        try:
            if self._asked is None and self._rates is None:
                saved = load_profile()
                if saved is None:
                    return None
                self._rates = Rates.from_profile(saved)
            ev = self(policy, self._asked, forward_backward)
        except ConfigError:  # a profile that lacks a figure: report() says nothing rather than fail
            return None
        return dict(ev.stages) if ev.stages else None

    def __call__(self, policy: Policy, profile: Any = None, forward_backward: float = 0.0) -> Evaluation:
        if profile is not None:
            self._asked = profile
        try:
            buckets, _, _, param_homes = plan(self.module, policy, self.spec, self.dtype, self.bucket_numel,
                                              overlap=self.overlap, world=self.world)
        except ConfigError as e:
            return Evaluation(False, {}, {}, {}, refused=str(e))
        frozen = [(p, param_homes.get(n, Tier.DEVICE)) for n, p in self.module.named_parameters()
                  if not p.requires_grad]
        need = totals(footprint(buckets, frozen, self.dtype, overlap=self.overlap, world=self.world,
                                largest_module=largest_module_bytes(self.module, param_homes, self.dtype)))
        slack = _rounding(buckets, frozen, self.dtype.itemsize, self.overlap)
        short = {t: n + slack[t] - self.limits.get(t, 0) for t, n in need.items()
                 if n and n + slack[t] > self.limits.get(t, 0)}
        refused = None
        if need[Tier.NVME] and Tier.NVME not in self.limits:
            refused = "it places tensors on NVMe and no nvme_dir is given"
        stages = predict(buckets, self.dtype.itemsize, self.rates(profile), forward_backward=forward_backward)
        return Evaluation(not short and refused is None, stages.stages, need, short, refused)

    def bind(self, policy: Policy) -> Policy:
        """``policy`` bound to this model, with this evaluator as its judge."""
        return bind(self.module, policy, self.dtype, self.limits, self)


_PAGE = 4096


def _rounding(buckets, frozen, w: int, overlap: bool) -> dict[Tier, int]:
    """What the footprint does not count: the host pool and the NVMe store round each buffer up to
    a page (4 KiB). Computed per buffer the layout allocates there (per bucket: its grads, two under
    overlap_step; its three parts of state, two slots per key on NVMe; its grads for the step; its
    output buffer; each weight living off the device; for the model: the weight staging, the NVMe
    state pipeline's nine buffers, the frozen weights' copies), plus a page for each buffer whose
    size varies (three pooled buffers of grads on their way to NVMe, four of weights fetched from
    their home). Nothing for the device: its store allocates exact sizes. So a layout judged to fit
    is one the constructor builds, even under budgets of a few pages."""
    def r(nbytes: int) -> int:
        return (-nbytes) % _PAGE
    out = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.NVME: 0}
    slots = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}  # copies kept per key
    staged, streamed = 0, 0
    for b in buckets:
        n, ct = b.numel, compute_tier(b)
        out[b.grad_tier] += slots[b.grad_tier] * r(4 * n) * (2 if overlap and b.grad_tier == Tier.HOST else 1)
        out[b.state_tier] += 3 * slots[b.state_tier] * r(4 * n)
        if ct == Tier.HOST and b.grad_tier not in (Tier.NVME, Tier.HOST):
            out[Tier.HOST] += r(4 * n)
        if ct == Tier.HOST and overlap:
            out[Tier.HOST] += r(w * n)
        elif ct == Tier.HOST:
            staged = max(staged, n)
        if b.state_tier == Tier.NVME:
            streamed = max(streamed, n)
        if b.param_tier != Tier.DEVICE:
            out[b.param_tier] += sum(slots[b.param_tier] * r(w * s.numel) for s in b.slots)
    out[Tier.HOST] += 2 * r(w * staged) + 9 * r(4 * streamed)
    out[Tier.HOST] += sum(r(p.numel() * p.element_size()) for p, _ in frozen)
    if any(b.grad_tier == Tier.NVME for b in buckets):
        out[Tier.HOST] += 3 * _PAGE
    if any(b.param_tier != Tier.DEVICE for b in buckets):
        out[Tier.HOST] += 4 * _PAGE
    return out
