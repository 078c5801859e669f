"""The step-time cost model: predicted seconds per stage of one training step for a bucket plan,
from the machine's measured rates (the profile ``tiermem bench`` keeps, :mod:`tiermem.plan.profile`).

Pure arithmetic, no I/O: ``policies.Auto`` ranks placements with it, ``tiermem plan --policy auto``
prints it, ``bench/split_step.py`` predicts a GPU's gain with it, and ``TieredModel.report()``
sets it beside the measured stages.

# NOTE [Cost model]
One step of a plan of buckets, each of ``n`` parameters, ``w`` bytes per working weight, in stages:

- ``forward+backward``: the compute, measured (a first forward/backward, at the precision in use),
  else predicted from the matmuls of a step at the precision's measured rate (``flops``: about 6
  per trainable and 4 per frozen parameter for each token, or row, a weight multiplies; the
  profile's matmul figure of that precision on the device, a CPU's one-thread figure times the
  threads torch uses: NOTE [A precision the CPU is slow at]), else 0; weights
  living off the device come in twice (forward and backward: ``w*n`` each way, NVMe read then
  host-to-device), prefetched behind the compute, so the stage is the longer of the two;
- ``grads home``: each device grad (``w*n``) leaves for a host or NVMe home as its bucket completes,
  during backward (taken as two thirds of the compute); what is exposed is the part that does not
  fit behind it, and at least the last bucket's trip, which starts when backward ends. On a CPU
  device the copy runs inside backward, on its thread (NOTE [A CPU device]): it is part of the
  forward+backward stage (added to a prediction from FLOPs; a measured one holds it), and only
  an NVMe write behind it can be exposed;
- ``grads to Adam``: fp32 grads copied where Adam runs when they live on another memory tier;
- ``grad norm``: one read of every fp32 grad (host memory bandwidth);
- ``optimizer``: the device's Adam over the device buckets and the CPU's over the others, where
  state on NVMe streams through (read and write its state format's bytes, ``12n`` for Adam's fp32
  state, concurrently with Adam: the longest of the three); the two processors run at once (NOTE [Split step]), so the stage is the longer of
  them, or their sum when the "device" is the CPU itself;
- ``weights up``: the host-updated weights (``w*n``) go to the device (or to their host home) behind
  the CPU's Adam; the last bucket's trip and whatever exceeds the CPU's Adam are exposed (weights on
  NVMe are written with the state, above). A bf16 master that is its weights (NOTE [One copy of
  bf16 master weights]) is read and written once, with the state, and sends no weights up; nor do
  weights on a CPU device, which the host's Adam writes in place (NOTE [A CPU device]).

The step is the sum of the stages. Transfers are taken at their measured bandwidth alone: the
model does not charge the CPU for driving the copies, nor memory bandwidth shared between Adam
and the transfers, nor the per-module cost of fetching weights that live off the device (hooks,
one transfer per module; policies.Auto places weights off the device only when they cannot stay
on it). bench/auto.py measures how far off that leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from tiermem.config.specs import PRECISIONS
from tiermem.errors import ConfigError
from tiermem.plan.buckets import Bucket
from tiermem.plan.placement import compute_tier, master_is_weights, weights_sharded
from tiermem.plan.profile import Profile
from tiermem.types import Tier

_FP32 = 4
BACKWARD_SHARE = 2 / 3  # of forward+backward: backward does twice forward's work

STAGES = ("forward+backward", "grads home", "grads to Adam", "grad norm", "optimizer", "weights up")


@dataclass(frozen=True)
class Rates:
    """What the cost model reads of a machine: bandwidths in bytes/s, Adam in parameters/s."""

    h2d: float
    d2h: float
    host_copy: float
    nvme_read: float
    nvme_write: float
    cpu_adam: float
    device_adam: float
    device_is_cpu: bool  # no accelerator: the device tier is the CPU (its Adam shares the cores)
    #: FLOP/s of a matmul on the device (where forward and backward run), by working precision;
    #: a precision absent was not measured
    matmul: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_profile(cls, profile: Profile) -> "Rates":
        """The rates of a saved profile; a figure it lacks is an error that says how to get it."""
        missing = []

        def need(value: Optional[float], what: str) -> float:
            if value is None:
                missing.append(what)
                return 0.0
            return value

        is_cpu = profile.data.get("device", {}).get("accelerator") is None
        cpu_adam = need(profile.adam_params_per_second(), "adam.tiermem_Gparams_per_s")
        device_adam = profile.device_adam_params_per_second()
        if device_adam is None and is_cpu:
            device_adam = cpu_adam  # the device's Adam is the CPU's kernel there
        matmul = {p: profile.matmul_flops(p, accelerator=not is_cpu) for p in PRECISIONS}
        threads = 1 if not is_cpu else torch.get_num_threads()  # the CPU's figures are one thread's
        rates = cls(
            h2d=need(profile.bandwidth(Tier.HOST, Tier.DEVICE), "device.h2d_GBps"),
            d2h=need(profile.bandwidth(Tier.DEVICE, Tier.HOST), "device.d2h_GBps"),
            host_copy=need(profile.bandwidth(Tier.HOST, Tier.HOST), "host.copy_GBps"),
            nvme_read=need(profile.bandwidth(Tier.NVME, Tier.HOST), "nvme.read_GBps"),
            nvme_write=need(profile.bandwidth(Tier.HOST, Tier.NVME), "nvme.write_GBps"),
            cpu_adam=cpu_adam,
            device_adam=need(device_adam, "adam.device_Gparams_per_s"),
            device_is_cpu=is_cpu,
            matmul={p: r * threads for p, r in matmul.items() if r is not None},
        )
        if missing:
            raise ConfigError(
                f"tiermem: the machine profile lacks {', '.join(missing)}; run `tiermem bench` "
                f"to measure this machine again"
            )
        return rates


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of each stage of one step (NOTE [Cost model])."""

    stages: dict[str, float]

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    def __str__(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.stages.items()) + f" = {self.seconds * 1e3:.1f} ms"


def step_flops(trainable: int, frozen: int, tokens: int) -> float:
    """About the matmul FLOPs of one step's forwards and backwards (NOTE [Cost model]): each weight
    multiplies each of ``tokens`` rows (tokens for a language model; all micro-batches) forward (2
    FLOPs), and backward for the input's gradient (2) and, when trainable, its own (2). Attention's
    own products and elementwise ops are not counted."""
    return float(tokens) * (6 * trainable + 4 * frozen)


def compute_seconds(
    rates: Rates, *, forward_backward: float = 0.0, flops: float = 0.0, precision: Optional[str] = None
) -> float:
    """The forward+backward seconds the prediction uses: measured when given, else ``flops`` at the
    device's matmul rate in ``precision``, else 0 (NOTE [Cost model])."""
    if forward_backward or not flops:
        return forward_backward
    rate = rates.matmul.get(precision) if precision is not None else None
    if rate is None:
        raise ConfigError(
            f"tiermem: the machine profile has no {precision} matmul figure to predict forward and "
            f"backward from; run `tiermem bench` to measure this machine again, or give the measured "
            f"forward+backward seconds"
        )
    return flops / rate


def _state_io(buckets: Sequence[Bucket], w: int, rates: Rates, one_copy: set[int]) -> tuple[float, float]:
    """Seconds to read and to write the optimizer state streamed from NVMe (and the weights homed
    there beside it, unless they are their bf16 master: ``one_copy``), each bucket's state as its
    format keeps it (NOTE [State formats]: 12 B/param for Adam's fp32 state)."""
    streamed = [b for b in buckets if b.state_tier == Tier.NVME]
    read = sum(b.joined_bytes() for b in streamed)
    written = sum(
        b.joined_bytes() + (b.numel * w if b.param_tier == Tier.NVME and b.index not in one_copy else 0)
        for b in streamed
    )
    return read / rates.nvme_read, written / rates.nvme_write


def _weights_up(buckets: Sequence[Bucket], w: int, rates: Rates, one_copy: set[int], host_part: float) -> float:
    """Seconds of new weights going home after the host's update that it does not hide (``host_part``:
    the update's own seconds): none for weights written in place (NOTE [A CPU device]), homed on NVMe
    or their bf16 master (``one_copy``)."""
    ups = [
        b.numel * w / (rates.h2d if b.param_tier == Tier.DEVICE else rates.host_copy)
        for b in buckets
        if compute_tier(b) != Tier.DEVICE
        and b.param_tier != Tier.NVME
        and b.index not in one_copy
        and not (rates.device_is_cpu and b.param_tier == Tier.DEVICE)
    ]
    return max(ups[-1], sum(ups) - host_part) if ups else 0.0


def predict(
    buckets: Sequence[Bucket],
    itemsize: int,
    rates: Rates,
    *,
    forward_backward: float = 0.0,
    flops: float = 0.0,
    precision: Optional[str] = None,
    overlap: bool = False,
    world: int = 1,
    shard_weights: bool = False,
) -> Prediction:
    """Predicted seconds per stage of one step of ``buckets`` with ``itemsize``-byte working weights
    (NOTE [Cost model]); ``forward_backward``: the compute's measured seconds, 0 when unknown;
    ``flops``: the step's matmul FLOPs (:func:`step_flops`), which predict the compute in
    ``precision`` (a name of tiermem.config.specs.PRECISIONS) when it is not measured; ``overlap``
    (overlap_step) and which buckets' weights are sharded over the ranks (``world`` data-parallel
    ranks, ``shard_weights``: :func:`~tiermem.plan.placement.weights_sharded`) decide which
    buckets' weights are their bf16 master (:func:`~tiermem.plan.placement.master_is_weights`): no
    weights of their own to write."""
    measured = forward_backward > 0
    forward_backward = compute_seconds(rates, forward_backward=forward_backward, flops=flops, precision=precision)
    w = itemsize
    fetch = sum(
        b.numel * w * (2 / rates.nvme_read if b.param_tier == Tier.NVME else 0) + 2 * b.numel * w / rates.h2d
        for b in buckets
        if b.param_tier != Tier.DEVICE
    )
    homed = [b for b in buckets if b.grad_tier != Tier.DEVICE]  # in the order backward completes them
    copies = [b.numel * w / rates.d2h for b in homed]
    writes = [b.numel * _FP32 / rates.nvme_write if b.grad_tier == Tier.NVME else 0.0 for b in homed]
    if rates.device_is_cpu:  # each copy runs inside backward, on its thread (NOTE [A CPU device])
        trips = [t for t in writes if t]
        forward_backward += 0.0 if measured else sum(copies)
    else:
        trips = [c + t for c, t in zip(copies, writes)]
    grads_home = max(trips[-1], sum(trips) - BACKWARD_SHARE * forward_backward) if trips else 0.0
    to_adam = sum(
        b.numel * _FP32 / _bandwidth(rates, b.grad_tier, compute_tier(b))
        for b in buckets
        if b.grad_tier != Tier.NVME and b.grad_tier != compute_tier(b)
    )
    norm = sum(b.numel * _FP32 for b in buckets if b.grad_tier != Tier.DEVICE or rates.device_is_cpu) / rates.host_copy
    on_device = sum(b.numel for b in buckets if compute_tier(b) == Tier.DEVICE)
    on_host = sum(b.numel for b in buckets if compute_tier(b) != Tier.DEVICE)
    # NOTE [One copy of bf16 master weights]: the master read and written once, as the weights
    one_copy = {b.index for b in buckets if master_is_weights(b, weights_sharded(b, world, shard_weights), overlap)}
    host_part = max(on_host / rates.cpu_adam, *_state_io(buckets, w, rates, one_copy))
    device_part = on_device / rates.device_adam
    optimizer = device_part + host_part if rates.device_is_cpu else max(device_part, host_part)
    weights_up = _weights_up(buckets, w, rates, one_copy, host_part)
    return Prediction(
        {
            "forward+backward": max(forward_backward, fetch),
            "grads home": grads_home,
            "grads to Adam": to_adam,
            "grad norm": norm,
            "optimizer": optimizer,
            "weights up": weights_up,
        }
    )


def _bandwidth(rates: Rates, src: Tier, dst: Tier) -> float:
    if src == dst or Tier.DEVICE not in (src, dst):
        return rates.host_copy
    return rates.h2d if dst == Tier.DEVICE else rates.d2h


def against_measured(
    predicted: dict[str, float], *, forward_backward: float, grads_home: float, step: float
) -> dict[str, tuple[float, float]]:
    """``predicted`` stages beside what a run measured, per step: forward+backward (inside ``tm(...)``
    and ``tm.backward``), the wait for the last grads at the start of ``step()``, and the rest of
    ``step()`` (the other stages, which it runs)."""
    rest = {k: v for k, v in predicted.items() if k not in ("forward+backward", "grads home")}
    return {
        "forward+backward": (predicted["forward+backward"], forward_backward),
        "grads home": (predicted["grads home"], grads_home),
        "norm, Adam, weights up": (sum(rest.values()), step - grads_home),
    }
