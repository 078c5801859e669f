"""The planner's judge of candidate placements (NOTE [Choosing a placement] in tiermem/plan/policy.py).

:class:`Evaluator` plans the buckets a candidate policy gives a model with the same functions
TieredModel's constructor calls (:func:`tiermem.plan.placement.plan`,
:func:`tiermem.plan.footprint.footprint`), checks them against the tiers' limits as the constructor
checks its stores (the footprint as it is, page rounding and the NVMe journal included: no allowance
of the planner's own, so a layout judged to fit is one the constructor builds, and one it builds is
never judged not to fit), and predicts a step's seconds per stage (:mod:`tiermem.plan.cost`). Nothing is
allocated: the module may live on the meta device.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from tiermem.config.specs import precision_of
from tiermem.errors import ConfigError
from tiermem.plan.cost import Rates, predict as predict_stages, step_flops
from tiermem.plan.footprint import model_footprint, totals
from tiermem.plan.placement import bind, plan
from tiermem.plan.policy import Evaluation, Policy
from tiermem.plan.profile import Profile, load_profile
from tiermem.types import Tier


class Evaluator:
    """``evaluator(policy, profile=None, forward_backward=0.0, *, tokens=0, predict=True) -> Evaluation``
    for one model and configuration (``tokens``: the rows a weight multiplies in a step, which predict
    the compute when ``forward_backward`` is 0, NOTE [Cost model]; ``predict=False``: the bytes
    alone, no stages, no profile). ``limits``: the bytes each tier's store may hold (a tier without a store is
    absent); ``machine``: returns this machine's profile (called once, when first needed);
    ``nvme_staging``, ``device_is_host``: as :func:`~tiermem.plan.footprint.footprint` takes them
    (True on a GPU; True on a CPU device); ``inference``: a model built for inference, whose every
    parameter the policy is told about (``ModelInfo.inference``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        spec: Any,
        dtype: torch.dtype,
        bucket_numel: int,
        *,
        limits: Mapping[Tier, int],
        machine: Callable[[], Profile],
        overlap: bool = False,
        world: int = 1,
        nvme_staging: bool = False,
        shard_weights: bool = False,
        device_is_host: bool = False,
        inference: bool = False,
    ):
        self.module, self.spec, self.dtype, self.bucket_numel = module, spec, dtype, bucket_numel
        self.limits, self.overlap, self.world, self.nvme_staging = dict(limits), overlap, world, nvme_staging
        self.shard_weights, self.device_is_host, self.inference = shard_weights, device_is_host, inference
        self._machine = machine
        self._rates: Optional[Rates] = None  # this machine's, once asked for

    def rates(self, profile: Any = None) -> Rates:
        """The rates of ``profile`` (a Profile or its data), or of this machine's when None."""
        if profile is not None:
            return Rates.from_profile(profile if isinstance(profile, Profile) else Profile(profile))
        if self._rates is None:
            self._rates = Rates.from_profile(self._machine())
        return self._rates

    def predict(self, policy: Policy, forward_backward: float) -> Optional[dict[str, float]]:
        """Predicted seconds per stage of ``policy``'s step with the measured ``forward_backward``,
        from the profile the placement was chosen with (a bound policy's ``profile``: Auto's
        choice) or else this machine's (a saved one; None when there is none: nothing is measured
        for it), or None when the profile lacks a figure the cost model needs. Nothing an earlier
        call judged changes the answer."""
        chosen_with = getattr(policy, "profile", None)  # NOTE [Choosing a placement]
        try:
            if chosen_with is None and self._rates is None:
                saved = load_profile()
                if saved is None:
                    return None
                self._rates = Rates.from_profile(saved)
            ev = self(policy, chosen_with, forward_backward)
        except ConfigError:  # a profile that lacks a figure: report() says nothing rather than fail
            return None
        return dict(ev.stages) if ev.stages else None

    def __call__(
        self,
        policy: Policy,
        profile: Any = None,
        forward_backward: float = 0.0,
        *,
        tokens: int = 0,
        predict: bool = True,
    ) -> Evaluation:
        try:
            planned = plan(
                self.module,
                policy,
                self.spec,
                self.dtype,
                self.bucket_numel,
                overlap=self.overlap,
                world=self.world,
                inference=self.inference,
            )
        except ConfigError as e:
            return Evaluation(False, {}, {}, {}, refused=str(e))
        buckets, param_homes = planned.buckets, planned.weight_homes
        need = totals(
            model_footprint(
                self.module,
                buckets,
                param_homes,
                self.dtype,
                overlap=self.overlap,
                world=self.world,
                shard_weights=self.shard_weights,
                nvme_staging=self.nvme_staging,
                device_is_host=self.device_is_host,
                bucket_numel=self.bucket_numel,
            )
        )
        short = {t: n - self.limits.get(t, 0) for t, n in need.items() if n and n > self.limits.get(t, 0)}
        refused = None
        if need[Tier.NVME] and Tier.NVME not in self.limits:
            refused = "it places tensors on NVMe and no nvme_dir is given"
        flops = step_flops(*self._counts(), tokens) if tokens else 0.0
        stages = (
            predict_stages(
                buckets,
                self.dtype.itemsize,
                self.rates(profile),
                forward_backward=forward_backward,
                flops=flops,
                precision=precision_of(self.dtype),
                overlap=self.overlap,
                world=self.world,
                shard_weights=self.shard_weights,
            ).stages
            if predict
            else {}
        )
        return Evaluation(not short and refused is None, stages, need, short, refused)

    def _counts(self) -> tuple[int, int]:
        """Trainable and frozen parameters of the model (tied ones once), the whole of them on every rank."""
        params = list(self.module.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        return trainable, sum(p.numel() for p in params) - trainable

    def bind(self, policy: Policy) -> Policy:
        """``policy`` bound to this model, with this evaluator as its judge."""
        return bind(self.module, policy, self.dtype, self.limits, self, inference=self.inference)
