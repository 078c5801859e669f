"""Where a model's bytes live: the placement plan turned into homes that own real buffers.

For each bucket (see :mod:`tiermem.plan.buckets`), :func:`make_homes` picks one home per class
(NOTE [Homes]): the gradient accumulation, the optimizer state and the working weights, each
from the tier the policy chose. :func:`build` then fills them with the module's weights: the fp32
master from the parameters, the working weights rounded from it, the moments zero. Frozen
parameters move to the device in the working precision (or to their home, when it is off the
device), floating-point buffers too, as ``module.half()`` would.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch

from tiermem.errors import ConfigError, OutOfTierMemory, fmt_bytes
from tiermem.plan.buckets import Bucket, Slot
from tiermem.plan.placement import compute_tier
from tiermem.train.homes import DeviceWeights, GradHome, Homes, MemoryGrads, MemoryState, StateHome, WeightHome
from tiermem.train.nvme_grads import NvmeGrads
from tiermem.train.nvme_state import NvmeState
from tiermem.train.param_offload import ParamOffload
from tiermem.types import TensorClass, Tier


@dataclass(frozen=True)
class Layout:
    """The buckets and their homes, and what the module's own tensors became."""

    buckets: list[Bucket]
    homes: Homes
    groups: list[list[str]]  # canonical parameter names per optimizer param group
    names: dict[int, list[str]]  # id(param) -> every name it has (tied weights have several)
    slot_of: dict[int, tuple[Bucket, Slot]]  # id(param) -> its place
    frozen: dict[str, torch.Tensor]  # name -> fp32 copy on the host
    buffer_dtypes: dict[str, torch.dtype]  # the module's buffers' dtypes as given
    n_params: int


# TEMPORARY: moving to tiermem.plan.footprint (one rule for the constructor and `tiermem plan`)
def needed_bytes(buckets: list[Bucket], frozen: list[tuple[torch.nn.Parameter, Tier]], dtype: torch.dtype,
                 device_grad_bytes: int, overlap: bool = False) -> dict[Tier, dict[str, int]]:
    """Bytes each tier must hold, by purpose, for the layout to be built and a step to run."""
    need: dict[Tier, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    w = dtype.itemsize
    for b in buckets:
        ct = compute_tier(b)
        # NVMe holds each value and the previous one (a failed step can be undone): twice the bytes
        need[b.param_tier]["working weights"] += b.numel * w * (2 if b.param_tier == Tier.NVME else 1)
        need[b.grad_tier]["fp32 grads"] += b.numel * 4 * (2 if b.grad_tier == Tier.NVME else 1)
        if b.state_tier == Tier.NVME:
            need[Tier.NVME]["optimizer state (latest and previous)"] += b.numel * 24
        else:
            need[b.state_tier]["optimizer state"] += b.numel * 12
        if ct != b.grad_tier and b.grad_tier != Tier.NVME:
            need[ct]["grads for the step"] += b.numel * 4
        if overlap:
            need[b.grad_tier]["second grad buffer (overlap_step)"] += b.numel * 4
            need[ct]["updated weights (overlap_step)"] += b.numel * w
    grads_largest = max((b.numel for b in buckets if b.grad_tier == Tier.NVME), default=0)
    if grads_largest:
        need[Tier.HOST]["grads on their way to NVMe (about 3 buckets)"] += 3 * 4 * grads_largest
    nvme_largest = max((b.numel for b in buckets if b.state_tier == Tier.NVME), default=0)
    if nvme_largest:
        need[Tier.HOST]["optimizer state pipeline (3 buckets)"] += 3 * 12 * nvme_largest
    largest: dict[Tier, int] = defaultdict(int)
    for b in buckets:
        if compute_tier(b) != Tier.DEVICE:
            largest[compute_tier(b)] = max(largest[compute_tier(b)], b.numel)
    for tier, numel in (largest.items() if not overlap else ()):
        count = min(2, sum(1 for b in buckets if compute_tier(b) == tier))
        need[tier]["weight staging (up to 2 buckets)"] += count * numel * w
    for p, home in frozen:
        need[home]["frozen weights"] += (p.numel() * (w if p.is_floating_point() else p.element_size())
                                         * (2 if home == Tier.NVME else 1))
        need[Tier.HOST]["fp32 copy of frozen weights"] += p.numel() * p.element_size()
    need[Tier.DEVICE]["grads in flight (largest parameter)"] += device_grad_bytes
    return need


def largest_module_bytes(module: torch.nn.Module, param_homes: dict[str, Tier], dtype: torch.dtype) -> int:
    """The off-device weights one module makes resident while it runs (the device's minimum)."""
    best = 0
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        best = max(best, sum(p.numel() * dtype.itemsize for n, p in mod.named_parameters(recurse=False)
                             if prefix + n in param_homes))
    return best


def check_fits(need: dict[Tier, dict[str, int]], stores: dict) -> None:
    for tier, parts in need.items():
        total = sum(parts.values())
        if tier not in stores:
            raise ConfigError(f"tiermem: the policy places tensors on {tier} but no {tier} store is "
                              f"configured; pass nvme_dir=... to TieredModel")
        store = stores[tier]
        if store.used + total > store.allowed:
            detail = " + ".join(f"{what} {fmt_bytes(n)}" for what, n in parts.items() if n)
            raise OutOfTierMemory(
                tier=tier, key="<model working set>", asked=total, used=store.used, allowed=store.allowed,
                hint=f"it needs {fmt_bytes(total)} there ({detail}); raise Budgets({tier.value}=...) to "
                     f"at least {fmt_bytes(store.used + total)} or choose a policy that places less on {tier}")


def _by_tier(buckets: list[Bucket], tier_of) -> dict[Tier, list[Bucket]]:
    out: dict[Tier, list[Bucket]] = {}
    for b in buckets:
        out.setdefault(tier_of(b), []).append(b)
    return out


def make_homes(buckets: list[Bucket], stores: dict, engine, dtype: torch.dtype, *, overlap: bool,
               weights_off_device: Optional[ParamOffload]) -> Homes:
    """One home per class and tier, shared by the buckets placed there: the only code that maps
    a tier to the class that homes it."""
    compute = {b.index: compute_tier(b) for b in buckets}
    grads: dict[int, GradHome] = {}
    for tier, bs in _by_tier(buckets, lambda b: b.grad_tier).items():
        home: GradHome = (NvmeGrads(bs, engine, stores[Tier.HOST]) if tier == Tier.NVME else
                          MemoryGrads(stores[tier], bs, compute, stores, engine, buffers=2 if overlap else 1))
        grads.update({b.index: home for b in bs})
    state: dict[int, StateHome] = {}
    for tier, bs in _by_tier(buckets, lambda b: b.state_tier).items():
        sh: StateHome = NvmeState(bs, engine, stores[Tier.HOST]) if tier == Tier.NVME else MemoryState(stores[tier], bs)
        assert all(sh.compute_tier == compute[b.index] for b in bs), "homes and plan disagree on where Adam runs"
        state.update({b.index: sh for b in bs})
    weights: dict[int, WeightHome] = {}
    on_device = [b for b in buckets if b.param_tier == Tier.DEVICE]
    if on_device:
        dw = DeviceWeights(stores[Tier.DEVICE], on_device, dtype, engine)
        weights.update({b.index: dw for b in on_device})
    for b in buckets:
        if b.param_tier != Tier.DEVICE:
            assert weights_off_device is not None, "weights off the device without their home"
            weights[b.index] = weights_off_device
    return Homes(grads, state, weights)


def build(module: torch.nn.Module, buckets: list[Bucket], groups: list[list[str]], names: dict[int, list[str]],
          homes: Homes, stores: dict, dtype: torch.dtype, device: torch.device,
          weights_off_device: Optional[ParamOffload]) -> Layout:
    """Fill the homes from the module's weights and point its parameters at their working copies."""
    slot_of: dict[int, tuple[Bucket, Slot]] = {}
    for b in buckets:
        state = homes.state[b.index]
        master = state.initial_master(b)
        for s in b.slots:
            master[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            slot_of[id(s.param)] = (b, s)
        homes.weights[b.index].initialize(b, master)
        state.initialize(b)
    frozen = _place_frozen(module, stores, dtype, device, weights_off_device)
    return Layout(buckets, homes, groups, names, slot_of, frozen, _cast_buffers(module, dtype, device),
                  sum(b.numel for b in buckets))


def _place_frozen(module: torch.nn.Module, stores: dict, dtype: torch.dtype, device: torch.device,
                  weights_off_device: Optional[ParamOffload]) -> dict[str, torch.Tensor]:
    """Frozen parameters: an fp32 copy on the host (for checkpoints and detach), the working copy
    on the device or at its home off the device."""
    frozen: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        frozen[name] = stores[Tier.HOST].allocate(f"{name}:frozen", p.shape, p.dtype, TensorClass.PARAM)
        frozen[name].copy_(p.detach())
        target = dtype if p.is_floating_point() else p.dtype
        if weights_off_device is not None and name in weights_off_device.homes:
            weights_off_device.adopt(name, p.detach().to(dtype=target, copy=True))
        else:
            p.data = stores[Tier.DEVICE].adopt(f"{name}:frozen", p.detach().to(device=device, dtype=target),
                                               TensorClass.PARAM)
    return frozen


def _cast_buffers(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, torch.dtype]:
    """Floating-point buffers (e.g. BatchNorm running stats) move to the working precision, as
    with module.half(): ops such as batch_norm need them in the dtype of their inputs. Returns
    their dtypes as given, for state_dict() and detach()."""
    dtypes: dict[str, torch.dtype] = {}
    for mod_name, mod in module.named_modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None:
                dtypes[f"{mod_name}.{bname}" if mod_name else bname] = buf.dtype
                mod._buffers[bname] = buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype)
    return dtypes
