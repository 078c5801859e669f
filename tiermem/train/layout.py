"""Where a model's bytes live: the policy's placements turned into buckets of flat buffers.

For each bucket (see :mod:`tiermem.plan.buckets`) the layout allocates, from the stores of the tiers
the policy chose:

- ``param``: the low-precision working weights on the device; the module's parameters become
  views into it, so one copy uploads a whole bucket;
- ``grad``: fp32 gradient accumulation at the GRAD tier;
- ``master``, ``exp_avg``, ``exp_avg_sq``: fp32 optimizer state at the OPTIM_STATE tier;
- ``grad_in``: an fp32 landing buffer at the OPTIM_STATE tier when grads live elsewhere.

When optimizer state lives off the device, Adam writes the updated low-precision weights into
one of two staging buffers per tier (each as large as the largest bucket), uploaded to the
device while Adam runs on the next bucket: host memory stays at 16 bytes per parameter plus
two buckets of staging.

Before allocating anything it checks that the working set fits each tier's budget and, if not,
says how much each tier needs.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from tiermem.plan.buckets import STATE_PARTS, Bucket, Slot, plan_buckets
from tiermem.config import _AdamSpec
from tiermem.errors import ConfigError, OutOfTierMemory, fmt_bytes
from tiermem.train.nvme_grads import NvmeGrads
from tiermem.train.nvme_state import NvmeState
from tiermem.plan.policy import Policy, checked_place
from tiermem.memory.resident import _MemoryStore
from tiermem.types import TensorClass, TensorInfo, Tier

#: Placements this version can honour, per tensor class (the rest arrive with the NVMe extension).
SUPPORTED = {
    TensorClass.PARAM: {Tier.DEVICE, Tier.HOST, Tier.NVME},
    TensorClass.GRAD: {Tier.DEVICE, Tier.HOST, Tier.NVME},
    TensorClass.OPTIM_STATE: {Tier.DEVICE, Tier.HOST, Tier.NVME},
    TensorClass.ACTIVATION: {Tier.DEVICE, Tier.HOST, Tier.NVME},  # asked per saved tensor, tiermem.train.activations
}


def compute_tier(b: Bucket) -> Tier:
    """Where Adam runs for a bucket: where its state lives, or the host for state on NVMe."""
    return Tier.HOST if b.state_tier == Tier.NVME else b.state_tier


@dataclass
class Buffers:
    param: Optional[torch.Tensor]  # None when the weights live off the device (see param_offload)
    grad: Optional[torch.Tensor]  # None when the grads live on NVMe (see nvme_grads)
    master: Optional[torch.Tensor]  # None when the state lives on NVMe (see nvme_state)
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    grad_in: Optional[torch.Tensor] = None  # grads copied to the state's tier for the step
    grad_alt: Optional[torch.Tensor] = None  # overlap_step: backward fills one while Adam reads the other
    param_out: Optional[torch.Tensor] = None  # overlap_step: Adam's low-precision output, uploaded next step

    def grad_buffer(self, which: int) -> torch.Tensor:
        return self.grad if which == 0 else self.grad_alt


@dataclass
class Layout:
    buckets: list[Bucket]
    buffers: dict[int, Buffers]
    groups: list[list[str]]  # canonical parameter names per optimizer param group
    names: dict[int, list[str]]  # id(param) -> every name it has (tied weights have several)
    slot_of: dict[int, tuple[Bucket, Slot]] = field(default_factory=dict)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> fp32 copy on host
    initial_params: dict[str, torch.Tensor] = field(default_factory=dict)  # off-device weights, until placed
    staging: dict[Tier, list[torch.Tensor]] = field(default_factory=dict)  # Adam's output, 2 per tier
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # buffers' dtypes as given
    nvme_state: Optional[NvmeState] = None  # the buckets whose optimizer state is on NVMe
    nvme_grads: Optional[NvmeGrads] = None  # the buckets whose gradients are on NVMe
    n_params: int = 0


def owner(name: str) -> str:
    return name.rpartition(".")[0]


def _place(policy: Policy, info: TensorInfo) -> Tier:
    tier = checked_place(policy, info)
    if tier not in SUPPORTED[info.kind]:
        raise ConfigError(
            f"tiermem: the policy places {info.name!r} ({info.kind}) on {tier}, which this version "
            f"cannot honour yet (supported for {info.kind}: "
            f"{', '.join(sorted(t.value for t in SUPPORTED[info.kind]))}); change the policy")
    return tier


def plan(module: torch.nn.Module, policy: Policy, spec: _AdamSpec, dtype: torch.dtype,
         bucket_numel: int) -> tuple[list[Bucket], list[list[str]], dict[int, list[str]], dict[str, Tier]]:
    """Ask the policy about every tensor, then pack trainable parameters into buckets. Also
    returns the parameters whose working weights live off the device, with their home."""
    param_homes: dict[str, Tier] = {}
    names: dict[int, list[str]] = defaultdict(list)
    unique: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            unique.append((name, p))
        names[id(p)].append(name)
    entries, groups = [], [[], []]  # group 0: weight decay applies; group 1: it does not
    for name, p in reversed(unique):  # reverse order of use: backward fills the last ones first
        param_tier = _place(policy, TensorInfo(name, TensorClass.PARAM, p.numel() * dtype.itemsize,
                                               tuple(p.shape), dtype, owner(name)))
        if param_tier != Tier.DEVICE:
            param_homes[name] = param_tier
        if not p.requires_grad:
            continue
        grad_tier = _place(policy, TensorInfo(name, TensorClass.GRAD, p.numel() * 4, tuple(p.shape),
                                              torch.float32, owner(name)))
        state_tiers = {_place(policy, TensorInfo(f"{name}:{part}", TensorClass.OPTIM_STATE, p.numel() * 4,
                                                 tuple(p.shape), torch.float32, owner(name)))
                       for part in STATE_PARTS}
        if len(state_tiers) != 1:
            raise ConfigError(f"tiermem: the policy splits the optimizer state of {name!r} over "
                              f"{sorted(t.value for t in state_tiers)}; master, exp_avg and exp_avg_sq "
                              f"of one parameter must share a tier")
        if grad_tier == Tier.NVME and Tier.DEVICE in state_tiers:
            raise ConfigError(f"tiermem: the policy places {name!r}'s grads on NVMe but its optimizer state on "
                              f"the device; grads on NVMe are read back to the host for the step: place "
                              f"OPTIM_STATE on HOST or NVME for it")
        if param_tier != Tier.DEVICE and Tier.DEVICE in state_tiers:
            raise ConfigError(f"tiermem: the policy places {name!r}'s weights on {param_tier} but its optimizer "
                              f"state on the device; this version updates off-device weights from host or "
                              f"NVMe state only: place OPTIM_STATE on HOST or NVME for it")
        group = 0 if spec.decays(name, p) else 1
        groups[group].append(name)
        entries.append((name, p, grad_tier, state_tiers.pop(), group, param_tier))
    if not groups[1]:
        groups.pop()
    return plan_buckets(entries, bucket_numel), groups, dict(names), param_homes


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


def check_fits(need: dict[Tier, dict[str, int]], stores: dict[Tier, _MemoryStore]) -> None:
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


def build(module: torch.nn.Module, buckets: list[Bucket], groups: list[list[str]],
          names: dict[int, list[str]], stores: dict[Tier, _MemoryStore], dtype: torch.dtype,
          device: torch.device, engine, overlap: bool = False,
          param_homes: Optional[dict[str, Tier]] = None) -> Layout:
    """Allocate every bucket's buffers, copy the module's weights in, and make its parameters
    views of the device buffers. Frozen parameters move to the device in the working precision."""
    layout = Layout(buckets, {}, groups, names)
    dev = stores[Tier.DEVICE]
    on_nvme = [b for b in buckets if b.state_tier == Tier.NVME]
    if on_nvme:
        layout.nvme_state = NvmeState(on_nvme, engine, stores[Tier.HOST])
    if any(b.grad_tier == Tier.NVME for b in buckets):
        if overlap:
            raise ConfigError("tiermem: overlap_step=True cannot be combined with grads on NVMe (the next "
                              "backward would overwrite grads the update still reads); place GRAD on HOST "
                              "or pass overlap_step=False")
        layout.nvme_grads = NvmeGrads(engine, stores[Tier.HOST])
    for b in buckets:
        ct = stores[compute_tier(b)]
        gt = stores[b.grad_tier] if b.grad_tier != Tier.NVME else None
        n = (b.numel,)
        buf = Buffers(
            param=dev.allocate(f"{b.key}:param", n, dtype, TensorClass.PARAM) if b.param_tier == Tier.DEVICE else None,
            grad=gt.allocate(f"{b.key}:grad", n, torch.float32, TensorClass.GRAD) if gt is not None else None,
            master=None, exp_avg=None, exp_avg_sq=None)
        if b.state_tier != Tier.NVME:
            st = stores[b.state_tier]
            buf.master = st.allocate(f"{b.key}:master", n, torch.float32, TensorClass.OPTIM_STATE)
            buf.exp_avg = st.allocate(f"{b.key}:exp_avg", n, torch.float32, TensorClass.OPTIM_STATE).zero_()
            buf.exp_avg_sq = st.allocate(f"{b.key}:exp_avg_sq", n, torch.float32, TensorClass.OPTIM_STATE).zero_()
        if compute_tier(b) != b.grad_tier and gt is not None:
            buf.grad_in = ct.allocate(f"{b.key}:grad_in", n, torch.float32, TensorClass.GRAD)
        if overlap:
            buf.grad_alt = gt.allocate(f"{b.key}:grad_alt", n, torch.float32, TensorClass.GRAD)
            buf.param_out = ct.allocate(f"{b.key}:param_out", n, dtype, TensorClass.PARAM)
        master = buf.master if buf.master is not None else layout.nvme_state.sets[0]["master"][:b.numel]
        for s in b.slots:
            master[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        if buf.param is not None:
            buf.param.copy_(master)  # the working copy is the master rounded to the working precision
        else:  # working weights live off the device: see param_offload
            for s in b.slots:
                # a copy, even in fp32: `master` may be a pipeline buffer the next bucket reuses
                layout.initial_params[s.name] = master[s.offset:s.offset + s.numel].view(s.shape).to(dtype, copy=True)
        if buf.master is None:
            layout.nvme_state.initialize(b, master)
        for s in b.slots:
            if buf.param is not None:
                s.param.data = buf.param[s.offset:s.offset + s.numel].view(s.shape)
            layout.slot_of[id(s.param)] = (b, s)
        layout.buffers[b.index] = buf
        layout.n_params += b.numel
    for tier in ({compute_tier(b) for b in buckets} - {Tier.DEVICE} if not overlap else ()):
        sizes = [b.numel for b in buckets if compute_tier(b) == tier]
        count = min(2, len(sizes))  # double buffering needs two; a single bucket needs one
        layout.staging[tier] = [stores[tier].allocate(f"staging{i}:param", (max(sizes),), dtype, TensorClass.PARAM)
                                for i in range(count)]
    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        layout.frozen[name] = stores[Tier.HOST].allocate(f"{name}:frozen", p.shape, p.dtype, TensorClass.PARAM)
        layout.frozen[name].copy_(p.detach())
        target = dtype if p.is_floating_point() else p.dtype
        if param_homes and name in param_homes:
            layout.initial_params[name] = p.detach().to(dtype=target, copy=True)
        else:
            p.data = dev.adopt(f"{name}:frozen", p.detach().to(device=device, dtype=target), TensorClass.PARAM)
    # Floating-point buffers (e.g. BatchNorm running stats) move to the working precision, as
    # with module.half(): ops such as batch_norm need them in the dtype of their inputs.
    for mod_name, mod in module.named_modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None:
                layout.buffer_dtypes[f"{mod_name}.{bname}" if mod_name else bname] = buf.dtype
                mod._buffers[bname] = buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype)
    return layout
