"""TieredModel: wrap any ``nn.Module`` and train it with ``tm(x)``, ``tm.backward(loss)``, ``tm.step()``.

Construction asks the policy where every tensor lives, packs trainable parameters into buckets
(:mod:`tiermem.train.layout`) and hooks each parameter's post-accumulate-grad event, so gradients
leave the device bucket by bucket while backward is still running. ``step()`` is the optimizer
step of :mod:`tiermem.train.stepper`.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tiermem.train import checkpoint
from tiermem.train.activations import ActivationOffloader
from tiermem.budgets import Budgets, parse_bytes
from tiermem.config import AdamW, _AdamSpec, working_dtype
from tiermem.transfer.engine import TransferEngine
from tiermem.errors import ConfigError
from tiermem.train.hooks import HookSet
from tiermem.train.layout import build, check_fits, largest_module_bytes, needed_bytes, plan
from tiermem.train.param_offload import ParamOffload
from tiermem.transfer.schedule import ResidencyScheduler
from tiermem.plan.policy import Policy, resolve_policy
from tiermem.observe.report import Report, collect
from tiermem.train.scaler import LossScaler
from tiermem.train.stepper import StepResult, Stepper, TieredOptimizer
from tiermem.memory.resident import DeviceStore, HostStore
from tiermem.memory.nvme import NvmeStore
from tiermem.observe.trace import Tracer
from tiermem.types import Tier

log = logging.getLogger(__name__)

__all__ = ["TieredModel", "StepResult"]


class TieredModel:
    """Train ``module`` with its tensors placed on tiers by ``policy`` (default: ZeRO-Offload).

    ``bucket_size`` is the fp32 bytes of gradient per bucket (smaller buckets start transfers
    earlier; larger ones make fewer, bigger copies). ``overlap_step=True`` runs each step's CPU
    update in the background while the next forward and backward run, so those see weights one
    update old (the one-step delayed update of ZeRO-Offload); the update lands at the next
    ``step()``; an update that fails in the background raises from that later call, and its
    gradients cannot be retried. Floating-point tensors passed to ``tm(...)`` are cast to the
    working precision.
    ``prefetch=False`` fetches weights homed off the device only when their module runs (for
    comparison; by default they are fetched ahead along the order the first step recorded).
    """

    def __init__(self, module: torch.nn.Module, policy: Optional[Policy] = None, *,
                 optimizer: Optional[_AdamSpec] = None, precision: str = "bf16",
                 budgets: Optional[Budgets] = None, nvme_dir: Optional[str] = None,
                 grad_clip: Optional[float] = None, device: torch.device | str | None = None,
                 bucket_size: int | str = "32MiB", overlap_step: bool = False,
                 trace_path: Optional[str] = None, prefetch: bool = True):
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"tiermem: TieredModel needs a torch.nn.Module, got {type(module).__name__}; "
                              f"pass the model itself")
        spec = AdamW() if optimizer is None else optimizer
        if not isinstance(spec, _AdamSpec):
            raise ConfigError(f"tiermem: optimizer={spec!r} is not a tiermem optimizer spec; pass "
                              f"tiermem.AdamW(...) or tiermem.Adam(...) (hyperparameters, not a torch optimizer)")
        if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
            raise ConfigError(f"tiermem: grad_clip={grad_clip!r} is invalid: must be a number > 0, or None")
        budgets = Budgets() if budgets is None else budgets
        if not isinstance(budgets, Budgets):
            raise ConfigError(f"tiermem: budgets={budgets!r} is not a tiermem.Budgets; pass Budgets(device=..., host=...)")
        bucket_bytes = parse_bytes(bucket_size, what="bucket_size")
        if bucket_bytes < 4:
            raise ConfigError(f"tiermem: bucket_size={bucket_size!r} is invalid: must be at least 4 bytes")
        self.module = module
        self.policy = resolve_policy(policy)
        self.precision = precision
        self.dtype = working_dtype(precision)
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.grad_clip = grad_clip
        self.overlap_step = bool(overlap_step)
        self.tracer = Tracer(trace_path)

        buckets, groups, names, param_homes = plan(module, self.policy, spec, self.dtype, bucket_bytes // 4)
        self.stores: dict[Tier, Any] = {Tier.DEVICE: DeviceStore(self.device, budgets.device),
                                        Tier.HOST: HostStore(budgets.host)}
        if nvme_dir is not None:
            self.stores[Tier.NVME] = NvmeStore(nvme_dir, budget=budgets.nvme)
        frozen = [(p, param_homes.get(n, Tier.DEVICE)) for n, p in module.named_parameters() if not p.requires_grad]
        biggest = max((s.numel for b in buckets for s in b.slots), default=0) * self.dtype.itemsize
        need = needed_bytes(buckets, frozen, self.dtype, biggest, self.overlap_step)
        if param_homes:
            need[Tier.DEVICE]["weights of the largest module, while it runs"] += largest_module_bytes(
                module, param_homes, self.dtype)
        check_fits(need, self.stores)
        self.engine = TransferEngine(self.stores, device=self.device, tracer=self.tracer if trace_path else None)
        self.layout = build(module, buckets, groups, names, self.stores, self.dtype, self.device, self.engine,
                            self.overlap_step, param_homes)
        self.scaler = LossScaler(enabled=precision == "fp16")
        self.stepper = Stepper(self.layout, self.engine, self.scaler, self.stores[Tier.DEVICE],
                               grad_clip=grad_clip, tracer=self.tracer, overlap=self.overlap_step)
        self.optimizer = TieredOptimizer(self.layout, spec, self.stepper)
        self.hooks = HookSet()
        for b in buckets:
            for s in b.slots:
                self.hooks.add(s.param.register_post_accumulate_grad_hook(self.stepper.on_grad))
        self.param_offload: Optional[ParamOffload] = None
        if param_homes:  # NOTE [Parameters off the device]
            # Fetch ahead up to a few modules' weights: enough to hide transfers, while leaving the
            # rest of the device budget to activations and grads in flight.
            room = self.stores[Tier.DEVICE].ledger.allowed - self.stores[Tier.DEVICE].ledger.used
            lookahead = min(4 * largest_module_bytes(module, param_homes, self.dtype), room // 2)
            scheduler = ResidencyScheduler(self.engine, Tier.DEVICE, lookahead_bytes=lookahead, prefetch=prefetch)
            self.stores[Tier.DEVICE].ledger.reclaim = scheduler.make_room  # activations may take that room
            self.param_offload = ParamOffload(module, param_homes, self.engine, scheduler, self.dtype, self.device,
                                              lambda name, p: self.layout.initial_params.pop(name), self.hooks)
            self.stepper.param_offload = self.param_offload
        self.activations = ActivationOffloader(module, self.policy, self.stores, self.engine, self.hooks,
                                               params=self.param_offload)
        self._detached = False
        log.info("tiermem: %s trainable parameters in %d buckets under %r (%s)",
                 f"{self.layout.n_params:,}", len(buckets), self.policy, precision)

    # -- the three calls ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_attached()
        args, kwargs = _cast_floats((args, kwargs), self.dtype, self.device)
        with self.tracer.span("forward", "compute"):
            if torch.is_grad_enabled() and self.module.training:
                with self.activations.track():
                    return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled in fp16); call once per micro-batch, grads accumulate.
        If it raises, this step's grads (earlier micro-batches too) are dropped: run the step's
        forward and backward again."""
        self._check_attached()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(f"tiermem: backward() needs a scalar loss tensor, got "
                              f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}; "
                              f"reduce the loss to one number (e.g. .mean())")
        if not loss.requires_grad:
            raise ConfigError("tiermem: backward() got a loss that does not require grad; compute it from "
                              "tm(...) outside torch.no_grad() and with the module in train mode")
        try:
            with self.tracer.span("backward", "compute"):
                (loss.float() * self.scaler.scale if self.scaler.enabled else loss).backward()
            self.stepper.end_backward()
        except BaseException:  # some grads are missing: drop the step's grads, never step on a mix
            self.stepper.drop_grads()
            raise
        finally:
            self.activations.release()

    def step(self) -> StepResult:
        """Update the weights from the accumulated grads, then clear them."""
        self._check_attached()
        result = self.optimizer.step()
        self.tracer.maybe_write()  # throttled: a full rewrite of a growing file; always at detach()
        return result

    # -- module-like conveniences ---------------------------------------------------------------
    def train(self, mode: bool = True) -> "TieredModel":
        self.module.train(mode)
        return self

    def eval(self) -> "TieredModel":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights (and buffers) with the keys of ``module.state_dict()``."""
        self.stepper.finish_pending()
        return checkpoint.module_state(self)

    def save(self, path: str) -> None:
        """Checkpoint weights, optimizer state, loss scale and step to ``path``, atomically."""
        self.stepper.finish_pending()
        checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save` (any bucket size, same parameter names)."""
        self.stepper.finish_pending()
        checkpoint.load(self, path)

    def report(self) -> Report:
        peak, class_peak, budgets = collect(self.stores)
        st = self.engine.stats.snapshot()
        return Report(peak_bytes=peak, class_peak_bytes=class_peak, bytes_moved=st["bytes_moved"],
                      stall_seconds=sum(st["stall_seconds"].values()), stall_seconds_per_tier=st["stall_seconds"],
                      busy_seconds=st["busy_seconds"], budgets=budgets, steps=self.stepper.steps,
                      class_bytes_moved=st["class_bytes_moved"],
                      n_params=self.layout.n_params, step_seconds=self.stepper.seconds)

    def detach(self) -> torch.nn.Module:
        """Remove every hook and give the module back with fp32 weights (on the CPU, where the
        master weights were), ready for plain PyTorch."""
        self._check_attached()
        self.stepper.finish_pending()
        self.hooks.remove()
        weights = checkpoint.fp32_weights(self)
        for name, p in self.module.named_parameters():
            p.data = weights[name]
        for mod_name, mod in self.module.named_modules():
            for bname, buf in list(mod._buffers.items()):
                if buf is not None:
                    full = f"{mod_name}.{bname}" if mod_name else bname
                    mod._buffers[bname] = buf.to("cpu", self.layout.buffer_dtypes.get(full, buf.dtype))
        self.engine.close()
        for store in self.stores.values():
            for key in list(store.keys()):
                store.delete(key)
            if isinstance(store, HostStore):
                store.trim()  # the pool's buffers (pinned, on a GPU machine) go back to the system
            if isinstance(store, NvmeStore):
                store.close()
        self.tracer.write()
        self._detached = True
        return self.module

    def _check_attached(self) -> None:
        if self._detached:
            raise ConfigError("tiermem: this TieredModel was detached; wrap the module again to keep training")

    def __repr__(self) -> str:
        return (f"TieredModel({type(self.module).__name__}, policy={self.policy!r}, precision={self.precision!r}, "
                f"params={self.layout.n_params:,}, buckets={len(self.layout.buckets)})")


def _cast_floats(obj: Any, dtype: torch.dtype, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device=device, dtype=dtype if obj.is_floating_point() else obj.dtype)  # one copy at most
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype, device) for k, v in obj.items()}
    return obj
