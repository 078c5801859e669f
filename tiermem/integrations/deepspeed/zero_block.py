"""A DeepSpeed config's ``zero_optimization`` block as a tiermem policy: ``offload_optimizer`` and
``offload_param`` give the homes of the optimizer state (and the fp32 gradients) and of the
weights, ``nvme_path`` the NVMe directory; the pairs DeepSpeed documents are tiermem's built-in
policies, others an :class:`OffloadPolicy` (NOTE [DeepSpeed config] in
:mod:`tiermem.integrations.deepspeed.walk`). ZeRO's tuning knobs are noted as not honoured, with why."""

from __future__ import annotations

import os
from typing import Mapping, Optional

from tiermem.config.rules import is_int
from tiermem.errors import ConfigError
from tiermem.integrations.deepspeed.reader import ABSENT, NO_SUCH_SETTING, Reader, block, short
from tiermem.plan.policy import PerClass, Policy
from tiermem.types import TensorClass, Tier

__all__ = ["OffloadPolicy", "placement"]

_DEVICES = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}

_BUFFERS = "tiermem sizes its own transfer buffers and buckets (bucket_size=, Budgets(...) cap them)"
_PREFETCH = "tiermem fetches weights ahead along the recorded module order, within Budgets(device=...)"
_SAVE = "tiermem checkpoints (tm.save) and tm.state_dict() always hold the fp32 master weights"

_ZERO_IGNORED = {
    **{
        k: _BUFFERS
        for k in (
            "contiguous_gradients",
            "reduce_scatter",
            "reduce_bucket_size",
            "allgather_partitions",
            "allgather_bucket_size",
            "overlap_comm",
            "use_multi_rank_bucket_allreduce",
            "round_robin_gradients",
            "sub_group_size",
            "zero_hpz_partition_size",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
            "zeropp_loco_param",
            "use_all_reduce_for_fetch_params",
        )
    },
    **{
        k: _PREFETCH
        for k in (
            "prefetch_bucket_size",
            "stage3_prefetch_bucket_size",
            "param_persistence_threshold",
            "stage3_param_persistence_threshold",
            "model_persistence_threshold",
            "stage3_model_persistence_threshold",
            "max_live_parameters",
            "stage3_max_live_parameters",
            "max_reuse_distance",
            "stage3_max_reuse_distance",
            "module_granularity_threshold",
        )
    },
    **{
        k: _SAVE
        for k in (
            "gather_16bit_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "load_from_fp32_weights",
            "elastic_checkpoint",
        )
    },
    "ignore_unused_parameters": "a parameter without a gradient is not updated that step, as in torch.optim",
    **{
        k: NO_SUCH_SETTING
        for k in (
            "legacy_stage1",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
        )
    },
}
_OFFLOAD_IGNORED = {
    k: _BUFFERS
    for k in ("buffer_count", "buffer_size", "max_in_cpu", "pipeline", "pipeline_read", "pipeline_write", "fast_init")
}


def _offload(r: Reader, zero: Mapping, key: str) -> tuple[Tier, Optional[str]]:
    """The home an ``offload_param``/``offload_optimizer`` block (``key``) gives, and its NVMe path."""
    offload = block(zero, key, "zero_optimization.")
    where = f"zero_optimization.{key}"
    device = offload.get("device", "none")
    if device not in _DEVICES:
        raise ConfigError(
            f'tiermem: DeepSpeed config {where}.device={short(device)} is invalid: it must be "none", "cpu" or "nvme"'
        )
    path = offload.get("nvme_path")
    for k, v in offload.items():
        if k == "device":
            continue
        if k == "nvme_path":
            if device != "nvme":
                r.note(f"{where}.nvme_path", v, f"the device is {device!r}, not 'nvme'")
        elif k == "pin_memory":
            if v is not True:
                r.note(f"{where}.pin_memory", v, "tiermem pins its host memory whenever an accelerator exists")
        elif k == "ratio":
            if v != 1:
                r.note(f"{where}.ratio", v, "tiermem offloads all of the optimizer state, not a fraction")
        elif k in _OFFLOAD_IGNORED:
            r.note(f"{where}.{k}", v, _OFFLOAD_IGNORED[k])
        else:
            raise ConfigError(
                f"tiermem: DeepSpeed config {where}.{k} is not a DeepSpeed offload setting (DeepSpeed "
                f"refuses it too); check the spelling: device, nvme_path, pin_memory, ..."
            )
    return _DEVICES[device], (path if device == "nvme" else None)


#: DeepSpeed's deprecated booleans and the block each stands for (true: device "cpu"; false: "none")
_DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _undeprecated(r: Reader, zero: Mapping) -> dict:
    """``zero`` with DeepSpeed's deprecated keys read as DeepSpeed reads them: ``cpu_offload`` and
    ``cpu_offload_param`` as the block each stands for (given beside that block, an error, as in
    DeepSpeed), ``cpu_offload_use_pin_memory`` ignored (DeepSpeed ignores it too); each one said."""
    zero = dict(zero)
    for old, new in _DEPRECATED.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(
                f"tiermem: DeepSpeed config zero_optimization.{old}={short(value)} is invalid: it must be "
                f'true or false; better, write {new}: {{"device": "cpu"}} (or leave it out) instead'
            )
        if new in zero:
            raise ConfigError(
                f"tiermem: DeepSpeed config has both zero_optimization.{old} (deprecated) and {new}, "
                f"which DeepSpeed refuses too; keep {new} alone"
            )
        zero[new] = {"device": "cpu" if value else "none"}
        r.deprecated(f"zero_optimization.{old}", value, f"{new}: {short(zero[new])}")
    if "cpu_offload_use_pin_memory" in zero:
        r.note(
            "zero_optimization.cpu_offload_use_pin_memory",
            zero.pop("cpu_offload_use_pin_memory"),
            "it is deprecated and DeepSpeed ignores it too; tiermem pins its host memory whenever an "
            "accelerator exists",
        )
    return zero


def placement(r: Reader, cfg: Mapping) -> tuple[Policy, Optional[str]]:
    """The policy the ``zero_optimization`` block describes, and the NVMe directory it names (or the
    ``nvme_dir`` keyword's)."""
    if isinstance(cfg.get("zero_optimization"), bool):  # DeepSpeed's oldest form, still read: a stage 1 switch
        on = cfg["zero_optimization"]
        r.deprecated("zero_optimization", on, f'zero_optimization: {{"stage": {int(on)}}}')
        cfg = {**cfg, "zero_optimization": {"stage": int(on)}}
    zero = block(cfg, "zero_optimization", "")
    stage = zero.get("stage", 0)
    if not is_int(stage) or stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"tiermem: DeepSpeed config zero_optimization.stage={short(stage)} is invalid: it must be 0, 1, 2 or 3"
        )
    zero = _undeprecated(r, zero)
    params, params_path = _offload(r, zero, "offload_param")
    state, state_path = _offload(r, zero, "offload_optimizer")
    if params is not Tier.DEVICE and stage != 3:
        raise ConfigError(
            f"tiermem: DeepSpeed config offloads parameters (offload_param) at stage {stage}; "
            f'DeepSpeed does that only at stage 3: write "stage": 3 or remove offload_param'
        )
    if "stage" in zero and stage == 3:
        r.note(
            "zero_optimization.stage",
            3,
            "tiermem keeps every rank's whole weights at their home "
            "(offload_param) instead of partitioning them across ranks",
        )
    elif "stage" in zero and stage in (0, 1):
        r.note(
            "zero_optimization.stage",
            stage,
            "tiermem shards gradients and optimizer state across data-parallel ranks, as stage 2 does",
        )
    for k, v in zero.items():
        if k in _ZERO_IGNORED:
            r.note(f"zero_optimization.{k}", v, _ZERO_IGNORED[k])
        elif k not in ("stage", "offload_param", "offload_optimizer"):
            raise ConfigError(
                f"tiermem: DeepSpeed config zero_optimization.{k} is not a ZeRO setting (DeepSpeed "
                f"refuses it too); check the spelling"
            )
    if params_path and state_path and os.path.normpath(params_path) != os.path.normpath(state_path):
        raise ConfigError(
            f"tiermem: DeepSpeed config gives two NVMe paths ({params_path!r} for parameters, "
            f"{state_path!r} for the optimizer); tiermem keeps both in one directory: give one path"
        )
    path = r.take(
        "zero_optimization.offload_*.nvme_path", params_path or state_path or ABSENT, "nvme_dir", default=None
    )
    grads = Tier.DEVICE if state is Tier.DEVICE else Tier.HOST  # ZeRO-Offload: fp32 grads where Adam runs
    return _policy_for(
        {
            TensorClass.PARAM: params,
            TensorClass.OPTIM_STATE: state,
            TensorClass.GRAD: grads,
            TensorClass.ACTIVATION: Tier.DEVICE,
        }
    ), path


class OffloadPolicy(PerClass):
    """One tier per tensor class, as a DeepSpeed config's offload settings give them."""

    def __init__(self, homes: Mapping[TensorClass, Tier]):
        self.homes = dict(homes)

    def __repr__(self) -> str:
        return "OffloadPolicy(" + ", ".join(f"{k.name}={self.homes[k].name}" for k in TensorClass) + ")"


def _policy_for(homes: dict[TensorClass, Tier]) -> Policy:
    """The built-in policy with these homes, else an :class:`OffloadPolicy` of them."""
    from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload  # lazy: policies import tiermem

    for builtin in (ZeroOffload, ZeroInfinity, KeepOnDevice):
        if dict(builtin.homes) == homes:
            return builtin()
    return OffloadPolicy(homes)
