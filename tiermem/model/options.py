"""TieredModel's keyword arguments, validated into one frozen :class:`Options`, and the stores
they ask for. Every error a user can cause by an argument is raised here, before anything is
built (STYLE habit 5); :mod:`tiermem.model.build` only wires what comes out.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from tiermem.config.budgets import Budgets, parse_bytes
from tiermem.config.rules import is_int, is_number
from tiermem.config.specs import AdamW, LossScale, _Spec, resolve_precision, working_dtype
from tiermem.config.torch_optim import spec_from_torch, supported_names
from tiermem.errors import ConfigError
from tiermem.memory.ledger import Reclaimer
from tiermem.memory.nvme import NvmeStore
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.transfer.collectives import Group
from tiermem.types import Tier

__all__ = ["Options", "validate", "make_stores", "DEFAULT_OPTIMIZER"]


class _DefaultOptimizer:
    """``optimizer=`` left out: ``tiermem.AdamW()``. Only ``optimizer=None`` given means inference
    (NOTE [Inference only] in tiermem/model/inference.py)."""

    def __repr__(self) -> str:
        return "AdamW()"


DEFAULT_OPTIMIZER: Any = _DefaultOptimizer()


@dataclass(frozen=True)
class Options:
    """The constructor's keyword arguments, validated."""

    spec: _Spec
    torch_optimizer: Optional[torch.optim.Optimizer]  # the one given as optimizer=, read into ``spec``
    grad_clip: Optional[float]  # a float (a numpy number given is converted), or None
    dtype: torch.dtype
    device: torch.device
    budgets: Budgets
    bucket_numel: int
    overlap: bool
    prefetch: bool
    precision: str  # the working precision: "auto" made this device's (NOTE [Choosing the precision])
    shard_weights: bool = False  # under data parallelism, weights on the device sharded too (ZeRO-3); alone, nothing
    update_in_backward: bool = False  # NOTE [Updates in backward]
    inference: bool = False  # optimizer=None: no grads, no master weights, no state (NOTE [Inference only])


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"tiermem: {name}={value!r} is not a bool; pass True or False")
    return value


def _device(device: Any) -> torch.device:
    """Where the working weights live: a CPU or an accelerator torch can reach."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(
            f"tiermem: device={device!r} is not a device; pass 'cpu', 'cuda', 'cuda:1' or a "
            f"torch.device (or leave it out: cuda when available, else cpu)"
        )
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"tiermem: device={device!r} is not a device torch knows; pass 'cpu' or 'cuda[:N]'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"tiermem: device={device!r}: tiermem trains on 'cpu' or 'cuda' devices; pass one of them")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"tiermem: device={device!r} but this torch has no usable CUDA device (torch "
            f"{torch.__version__}); pass device='cpu' or install a CUDA build of torch"
        )
    return dev


def _check_paths(nvme_dir: Any, trace_path: Any) -> None:
    if nvme_dir is not None and not isinstance(nvme_dir, (str, os.PathLike)):
        raise ConfigError(f"tiermem: nvme_dir={nvme_dir!r} is not a path; pass the directory as a str or Path")
    if trace_path is not None:
        if not isinstance(trace_path, (str, os.PathLike)):
            raise ConfigError(f"tiermem: trace_path={trace_path!r} is not a path; pass a file name as a str or Path")
        parent = os.path.dirname(os.path.abspath(trace_path))
        if not os.path.isdir(parent):
            raise ConfigError(
                f"tiermem: trace_path={str(trace_path)!r}: directory {parent!r} does not exist; "
                f"create it or choose another path"
            )


def _spec(optimizer: Any) -> tuple[_Spec, Optional[torch.optim.Optimizer]]:
    """The optimizer spec ``optimizer=`` asks for, and the torch optimizer it was read from (if one)."""
    torch_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    if optimizer is None or optimizer is DEFAULT_OPTIMIZER:
        spec: Any = AdamW()  # optimizer=None (inference) plans with it too: with no trainable bucket it keeps nothing
    else:
        spec = spec_from_torch(optimizer) if torch_optimizer is not None else optimizer
    if not isinstance(spec, _Spec):
        raise ConfigError(
            f"tiermem: optimizer={spec!r} is not an optimizer tiermem runs; pass tiermem.AdamW(...), "
            f"Adam, SGD, Adagrad, Lion, Adafactor, AdamW8bit or Adam8bit, or a torch.optim.Optimizer "
            f"built on the module's parameters ({supported_names()} fused, any other generically)"
        )
    return spec, torch_optimizer


def _check_grad_clip(grad_clip: Any) -> None:
    if grad_clip is not None and (not is_number(grad_clip) or not math.isfinite(grad_clip) or grad_clip <= 0):
        raise ConfigError(
            f"tiermem: grad_clip={grad_clip!r} is invalid: must be a finite number > 0 (the largest "
            f"global gradient norm), or None for no clipping"
        )


def _check_skips_and_scale(max_skipped_steps: Any, loss_scale: Any, precision: str, given: Any) -> None:
    """``max_skipped_steps`` and ``loss_scale``, the latter for fp16 only (``given``: the precision
    asked for, before "auto" became ``precision``)."""
    if max_skipped_steps is not None and (not is_int(max_skipped_steps) or max_skipped_steps < 1):
        raise ConfigError(
            f"tiermem: max_skipped_steps={max_skipped_steps!r} is invalid: must be an int >= 1, "
            f"or None to never stop on skipped steps"
        )
    if loss_scale is not None and (not isinstance(loss_scale, LossScale) or precision != "fp16"):
        auto = f" (precision={given!r} is {precision!r} here)" if given != precision else ""
        raise ConfigError(
            f"tiermem: loss_scale={loss_scale!r} is invalid: it must be a tiermem.LossScale, and "
            f"only precision='fp16' scales the loss{auto}; pass LossScale(...) with fp16, or leave it out"
        )


def _budgets_and_bucket(budgets: Any, bucket_size: Any) -> tuple[Budgets, int]:
    """``budgets`` (None: no caps) and ``bucket_size`` in bytes, checked."""
    budgets = Budgets() if budgets is None else budgets
    if not isinstance(budgets, Budgets):
        raise ConfigError(f"tiermem: budgets={budgets!r} is not a tiermem.Budgets; pass Budgets(device=..., host=...)")
    bucket_bytes = parse_bytes(bucket_size, what="bucket_size")
    if bucket_bytes < 4:
        raise ConfigError(f"tiermem: bucket_size={bucket_size!r} is invalid: must be at least 4 bytes")
    return budgets, bucket_bytes


def _when_updated(spec: _Spec, precision: str, update_in_backward: Any, overlap: bool) -> bool:
    """``update_in_backward``, checked with what it and bf16 master weights combine with."""
    if spec.bf16_stochastic_round and precision != "bf16":
        raise ConfigError(
            f"tiermem: {type(spec).__name__}(bf16_stochastic_round=True) keeps bf16 master weights, "
            f"which needs precision='bf16' (got {precision!r}); pass precision='bf16' or drop "
            f"bf16_stochastic_round"
        )
    in_backward = _flag("update_in_backward", update_in_backward)
    if in_backward and overlap:
        raise ConfigError(
            "tiermem: update_in_backward=True and overlap_step=True both change when the update runs; "
            "pass one of them (update_in_backward frees the grads' memory, overlap_step hides the update's time)"
        )
    return in_backward


def validate(
    module: Any,
    *,
    optimizer: Any,
    precision: Any,
    budgets: Any,
    grad_clip: Any,
    device: Any,
    bucket_size: Any,
    overlap_step: Any,
    nvme_dir: Any,
    trace_path: Any,
    prefetch: Any,
    max_skipped_steps: Any,
    loss_scale: Any,
    shard_weights: Any = False,
    update_in_backward: Any = False,
) -> Options:
    """Check every argument of ``TieredModel(...)``; the first one wrong raises a ConfigError naming it."""
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(
            f"tiermem: TieredModel needs a torch.nn.Module, got {type(module).__name__}; pass the model itself"
        )
    spec, torch_optimizer = _spec(optimizer)
    _check_grad_clip(grad_clip)
    budgets, bucket_bytes = _budgets_and_bucket(budgets, bucket_size)
    dev, overlap = _device(device), _flag("overlap_step", overlap_step)
    given, precision = precision, resolve_precision(precision, dev)
    dtype = working_dtype(precision)
    _check_paths(nvme_dir, trace_path)
    prefetch = _flag("prefetch", prefetch)
    _check_skips_and_scale(max_skipped_steps, loss_scale, precision, given)
    shard = _flag("shard_weights", shard_weights)
    in_backward = _when_updated(spec, precision, update_in_backward, overlap)
    inference = optimizer is None
    if inference:
        _check_inference(grad_clip=grad_clip, overlap_step=overlap, update_in_backward=in_backward)
    return Options(
        spec=spec,
        torch_optimizer=torch_optimizer,
        grad_clip=None if grad_clip is None else float(grad_clip),
        dtype=dtype,
        device=dev,
        budgets=budgets,
        bucket_numel=bucket_bytes // 4,
        overlap=overlap,
        prefetch=prefetch,
        precision=precision,
        shard_weights=shard,
        update_in_backward=in_backward,
        inference=inference,
    )


def _check_inference(**given: Any) -> None:
    """The training options an inference-only model (optimizer=None) refuses, naming the first given."""
    for name, value in given.items():
        if value not in (None, False):
            raise ConfigError(
                f"tiermem: {name}={value!r} is a training option, but optimizer=None builds a model for "
                f"inference only; leave {name} out, or pass an optimizer (e.g. tiermem.AdamW()) to train"
            )


def make_stores(
    opts: Options, nvme_dir: Optional[str], reclaimers: Sequence[Reclaimer], group: Group
) -> dict[Tier, Any]:
    """One store per tier the arguments ask for: device and host always, NVMe with a directory;
    ``reclaimers``: the device's (NOTE [Reclaimers at construction])."""
    stores: dict[Tier, Any] = {
        Tier.DEVICE: DeviceStore(opts.device, opts.budgets.for_tier(Tier.DEVICE), reclaimers=reclaimers),
        Tier.HOST: HostStore(opts.budgets.for_tier(Tier.HOST)),
    }
    if nvme_dir is not None:
        mine = group.subdirectory(nvme_dir)  # under data parallelism each rank its own: nvme_dir/rank<r>
        if mine != nvme_dir and os.path.isdir(nvme_dir):
            os.makedirs(mine, mode=0o700, exist_ok=True)
        else:
            mine = nvme_dir  # missing: the store's error names the directory the user gave
        # one value per key: a failed step is rolled forward, not back (tiermem/train/homes/nvme_state.py)
        stores[Tier.NVME] = NvmeStore(mine, budget=opts.budgets.nvme, keep_previous=False)
    return stores
