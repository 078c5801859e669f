"""``tiermem.from_deepspeed_config``: a DeepSpeed JSON config read as TieredModel options.

# NOTE [DeepSpeed config]
What a DeepSpeed config says, tiermem does where it has the same thing:

- ``zero_optimization.offload_optimizer.device`` (``none``/``cpu``/``nvme``) is the home of the
  optimizer state (and, off the device, of the fp32 gradients, as in ZeRO-Offload);
  ``offload_param.device`` the home of the weights; ``nvme_path`` the NVMe directory. The pairs
  DeepSpeed's documentation shows are tiermem's built-in policies: optimizer ``cpu`` =
  ``ZeroOffload``, both ``nvme`` = ``ZeroInfinity``, neither = ``KeepOnDevice``; other pairs get a
  :class:`tiermem.PerClass` policy with those homes.
- ``bf16``/``fp16`` ``enabled`` is the precision (neither: fp32); fp16's ``initial_scale_power``,
  ``loss_scale_window`` and ``min_loss_scale`` are a :class:`tiermem.LossScale`, with DeepSpeed's
  defaults for those left out (2**16, 1000, 1).
- ``gradient_clipping`` is ``grad_clip`` (0: none); the ``optimizer`` block (``Adam``/``AdamW``:
  ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode``) is ``tiermem.AdamW``/``Adam``, with
  DeepSpeed's defaults for what it leaves out (weight decay 0; ``Adam`` is AdamW unless
  ``adam_w_mode`` is false, as in DeepSpeed); ``Adagrad`` and ``Lion`` blocks are
  ``tiermem.Adagrad``/``Lion`` (the optimizers DeepSpeed runs on the CPU).

Every key it does not honour (tuning knobs of DeepSpeed's own buffers and collectives, a
scheduler block, a partial offload ratio...) is logged as one warning line that says why and
what tiermem does instead. Values that cannot be right (an unknown device, a typo inside a ZeRO
block, which DeepSpeed refuses too, bf16 and fp16 both enabled) raise a ``tiermem:`` error.

``"auto"`` (the Hugging Face Trainer's placeholder) takes the keyword argument of the same
meaning (``lr=``, ``precision=``, ``grad_clip=``...); without one it is an error. A keyword given
for a value the config sets to something else is an error too (as the Trainer's DeepSpeed
integration does): the config and the call must agree.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Mapping, Optional

import torch

from tiermem.config import Adam, AdamW, LossScale, is_int, is_number
from tiermem.optim_specs import Adagrad, Lion
from tiermem.errors import ConfigError
from tiermem.plan.policy import PerClass, Policy
from tiermem.train.model import TieredModel
from tiermem.types import TensorClass, Tier

log = logging.getLogger(__name__)

__all__ = ["from_deepspeed_config", "read_config", "translate"]

_ABSENT = object()

#: keyword arguments that fill or check a config value ("auto" takes them)
CONFIG_KEYWORDS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "precision",
    "grad_clip",
    "nvme_dir",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
)
#: keyword arguments passed to TieredModel (or the optimizer spec) as they are: the config has no say
PASS_THROUGH = (
    "budgets",
    "device",
    "bucket_size",
    "overlap_step",
    "trace_path",
    "prefetch",
    "process_group",
    "max_skipped_steps",
    "no_decay",
    "no_decay_1d",
)

_DEVICES = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}

_BUFFERS = "tiermem sizes its own transfer buffers and buckets (bucket_size=, Budgets(...) cap them)"
_PREFETCH = "tiermem fetches weights ahead along the recorded module order, within Budgets(device=...)"
_SAVE = "tiermem checkpoints (tm.save) and tm.state_dict() always hold the fp32 master weights"
_NONE = "tiermem has no such setting"
_REPORT = "tiermem reports through tm.report() and the logging module"
_COMMS = "tiermem reduces fp32 gradients over its process group; see the README's Data parallel section"

_TOP_IGNORED = {
    "scheduler": "tiermem leaves the learning-rate schedule to a torch lr scheduler on tm.optimizer "
    "(in the HF Trainer: lr_scheduler_type / warmup_steps)",
    "activation_checkpointing": "use the model's gradient checkpointing (torch.utils.checkpoint), and an "
    "ActivationOffload policy to keep activations off the device",
    "aio": "tiermem's NvmeStore runs its own I/O threads and block sizes",
    "zero_allow_untested_optimizer": "tiermem runs its own fused optimizers only",
    "zero_force_ds_cpu_optimizer": "tiermem runs its own fused optimizers only",
    "amp": "tiermem's precision is its weights' dtype (bf16/fp16 blocks), not apex AMP",
    **{
        k: _REPORT
        for k in (
            "steps_per_print",
            "wall_clock_breakdown",
            "dump_state",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "flops_profiler",
            "comms_logger",
            "memory_breakdown",
        )
    },
    **{
        k: _COMMS
        for k in (
            "communication_data_type",
            "prescale_gradients",
            "gradient_predivide_factor",
            "sparse_gradients",
            "seq_parallel_communication_data_type",
            "data_types",
        )
    },
}
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
        k: _NONE
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
_ADAM_IGNORED = {
    k: "tiermem's Adam is its own fused kernel, on the CPU or the device by policy" for k in ("torch_adam", "fused")
}
#: Adam's hyperparameters: DeepSpeed's defaults for those the config leaves out
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
#: fp16 loss-scale keys tiermem reads: DeepSpeed's defaults, also for "auto" (the Trainer has none of these)
_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "min_loss_scale": 1}
#: fp16 keys whose value tiermem always has: (is the value tiermem's?, why not honoured otherwise)
_FP16_FIXED = {
    "hysteresis": (lambda v: v == 1, "tiermem lowers the loss scale at the first overflow (hysteresis 1)"),
    "consecutive_hysteresis": (lambda v: not v, "tiermem lowers the loss scale at the first overflow"),
    "auto_cast": (lambda v: v is True, "tiermem always casts floating-point inputs to the working precision"),
    "fp16_master_weights_and_grads": (lambda v: not v, "tiermem's master weights and grads are fp32"),
}
#: the training loop's keys: checked against the keywords when given, otherwise noted with why
_LOOP = {
    "train_micro_batch_size_per_gpu": "the micro-batch size is your data loader's",
    "gradient_accumulation_steps": "call tm.backward(loss / N) once per micro-batch (DeepSpeed's "
    "engine divided by N) and tm.step() after the last",
    "train_batch_size": "the global batch size is your loop's (micro-batch x accumulation x ranks)",
}


class _Reader:
    """Walks one config, collecting TieredModel options and one note per key not honoured."""

    def __init__(self, overrides: Mapping[str, Any]):
        self.overrides = dict(overrides)
        self.notes: list[str] = []

    def note(self, where: str, value: Any, why: str) -> None:
        self.notes.append(f"tiermem: DeepSpeed config {where}={_short(value)} not honoured: {why}")

    def take(self, where: str, value: Any, name: str, *, default: Any = _ABSENT, norm=lambda v: v) -> Any:
        """The value of ``where``: the config's, or keyword ``name``'s where the config says "auto"
        or nothing; a keyword that disagrees with the config is an error."""
        given = self.overrides.get(name, _ABSENT)
        given = given if given is _ABSENT else norm(given)
        if value == "auto":
            if given is _ABSENT:
                raise ConfigError(
                    f"tiermem: DeepSpeed config {where}='auto' needs a value: pass {name}=... "
                    f"(the HF Trainer fills it from TrainingArguments) or write it in the config"
                )
            return given
        if value is _ABSENT:
            return default if given is _ABSENT else given
        value = norm(value)
        if given is not _ABSENT and given != value:
            raise ConfigError(
                f"tiermem: DeepSpeed config {where}={_short(value)} but {name}={given!r} was given; "
                f"make them agree, or write 'auto' in the config to take {name}"
            )
        return value


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _block(cfg: Mapping, key: str, where: str) -> dict:
    value = cfg.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(
            f"tiermem: DeepSpeed config {where}{key}={_short(value)} is not an object; write it as "
            f'{{"...": ...}} or leave it out'
        )
    return value


def _enabled(cfg: Mapping, key: str) -> Any:
    """A precision block's ``enabled``: True, False, "auto", or None when the block is absent."""
    if key not in cfg:
        return None
    value = _block(cfg, key, "").get("enabled", False)
    if value != "auto" and not isinstance(value, bool):
        raise ConfigError(f"tiermem: DeepSpeed config {key}.enabled={_short(value)} is not true, false or 'auto'")
    return value


def _precision(r: _Reader, cfg: Mapping) -> str:
    """The block enabled explicitly, else the ``precision`` keyword (as the HF Trainer adds the
    block its bf16=/fp16= asks for), else fp32 (DeepSpeed's default)."""
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ConfigError("tiermem: DeepSpeed config has both 'bf16' and 'bfloat16' (the same block); keep one")
    flags = {
        "bf16": _enabled({"bf16": cfg["bfloat16"]} if "bfloat16" in cfg else cfg, "bf16"),
        "fp16": _enabled(cfg, "fp16"),
    }
    on = [k for k, v in flags.items() if v is True]
    if len(on) == 2:
        raise ConfigError("tiermem: DeepSpeed config enables both bf16 and fp16; enable one of them")
    given = r.overrides.get("precision", _ABSENT)
    if given is _ABSENT:
        auto = [k for k, v in flags.items() if v == "auto"]
        if auto:
            raise ConfigError(
                f"tiermem: DeepSpeed config {auto[0]}.enabled='auto' needs a value: pass precision=... "
                f"(the HF Trainer takes it from bf16=/fp16=) or write true/false"
            )
        return on[0] if on else "fp32"
    if (on and on[0] != given) or flags.get(given) is False:
        why = f"enables {on[0]}" if on and on[0] != given else f"has {given}.enabled=false"
        raise ConfigError(
            f"tiermem: DeepSpeed config {why} but precision={given!r} was given; make them agree "
            f"(or write 'auto' for enabled)"
        )
    return given


def _loss_scale(r: _Reader, cfg: Mapping) -> LossScale:
    fp16 = _block(cfg, "fp16", "")
    for key, value in fp16.items():
        if key == "loss_scale" and value not in (0, 0.0, "auto"):
            raise ConfigError(
                f"tiermem: DeepSpeed config fp16.loss_scale={_short(value)} (a static loss scale) is "
                f"not supported: tiermem scales fp16 losses dynamically; write 0 or leave it out"
            )
        if key in _FP16_FIXED:
            ours, why = _FP16_FIXED[key]
            if not ours(value):
                r.note(f"fp16.{key}", value, why)
        elif key not in ("enabled", "loss_scale", *_FP16_DEFAULTS):
            r.note(f"fp16.{key}", value, _NONE)
    power, window, floor = (
        default if fp16.get(key, "auto") == "auto" else fp16[key] for key, default in _FP16_DEFAULTS.items()
    )
    if not is_int(power) or not 0 <= power < 126:
        raise ConfigError(
            f"tiermem: DeepSpeed config fp16.initial_scale_power={_short(power)} is invalid: it must "
            f"be an int in [0, 126) (the scale is 2**power)"
        )
    try:
        return LossScale(init_scale=2.0**power, growth_interval=window, min_scale=floor)
    except ConfigError as e:
        raise ConfigError(
            f"tiermem: DeepSpeed config fp16 block (loss_scale_window -> growth_interval, "
            f"min_loss_scale -> min_scale): {str(e).removeprefix('tiermem: ')}"
        ) from None


def _optimizer(r: _Reader, cfg: Mapping):
    """The ``optimizer`` block as a tiermem spec, by :data:`OPTIMIZER_BLOCKS` (no block: AdamW)."""
    block = _block(cfg, "optimizer", "")
    kind = block.get("type", "AdamW" if not block else _ABSENT)
    if kind is _ABSENT or not isinstance(kind, str) or kind.lower() not in OPTIMIZER_BLOCKS:
        raise ConfigError(
            f"tiermem: DeepSpeed config optimizer.type={_short(None if kind is _ABSENT else kind)} is "
            f"not supported: tiermem runs the types {', '.join(repr(k) for k in OPTIMIZER_BLOCKS)} (in any "
            f'case); write "AdamW" (or another of them)'
        )
    for key in block:
        if key not in ("type", "params"):
            r.note(f"optimizer.{key}", block[key], _NONE)
    return OPTIMIZER_BLOCKS[kind.lower()](r, kind, _block(block, "params", "optimizer."))


def _adam_block(r: _Reader, kind: str, params: Mapping):
    """``Adam``/``AdamW``: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode``."""
    unknown = sorted(set(params) - {*_ADAM_DEFAULTS, "adam_w_mode", *_ADAM_IGNORED, "bias_correction", "amsgrad"})
    if unknown:
        raise ConfigError(
            f"tiermem: DeepSpeed config optimizer.params has {unknown}, which Adam does not take; "
            f"use lr, betas, eps, weight_decay, adam_w_mode"
        )
    if params.get("bias_correction", True) is not True or params.get("amsgrad", False) is not False:
        raise ConfigError(
            "tiermem: DeepSpeed config optimizer.params asks for Adam without bias correction or "
            "with amsgrad; tiermem's Adam is torch's default (bias_correction true, amsgrad false)"
        )
    for key in _ADAM_IGNORED:
        if key in params:
            r.note(f"optimizer.params.{key}", params[key], _ADAM_IGNORED[key])
    w_mode = params.get("adam_w_mode", True)
    if not isinstance(w_mode, bool) or (kind.lower() == "adamw" and not w_mode):
        raise ConfigError(
            f"tiermem: DeepSpeed config optimizer.params.adam_w_mode={_short(w_mode)} with type "
            f'{kind!r}: write true/false with "Adam" (false: L2 penalty) or drop it with "AdamW"'
        )
    spec = AdamW if w_mode else Adam
    hyper = {
        k: r.take(
            f"optimizer.params.{k}",
            params.get(k, _ABSENT),
            k,
            default=default,
            norm=lambda v: tuple(v) if isinstance(v, list) else v,
        )  # JSON's betas are a list
        for k, default in _ADAM_DEFAULTS.items()
    }
    for key in ("no_decay", "no_decay_1d"):
        if key in r.overrides:
            hyper[key] = r.overrides[key]
    try:
        return spec(**hyper)
    except ConfigError as e:
        raise ConfigError(f"tiermem: DeepSpeed config optimizer block: {str(e).removeprefix('tiermem: ')}") from None


def _plain_block(spec: type, defaults: dict[str, Any]):
    """The reader of a ``params`` block that maps key for key onto ``spec`` (DeepSpeed's defaults
    for what it leaves out): Adagrad (``lr``, ``eps``, ``weight_decay``), Lion (``lr``, ``betas``,
    ``weight_decay``)."""

    def read(r: _Reader, kind: str, params: Mapping):
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            raise ConfigError(
                f"tiermem: DeepSpeed config optimizer.params has {unknown}, which {kind} does not take; "
                f"use {', '.join(defaults)}"
            )
        hyper = {
            k: r.take(
                f"optimizer.params.{k}",
                params.get(k, _ABSENT),
                k,
                default=default,
                norm=lambda v: tuple(v) if isinstance(v, list) else v,
            )
            for k, default in defaults.items()
        }
        for key in ("no_decay", "no_decay_1d"):
            if key in r.overrides:
                hyper[key] = r.overrides[key]
        try:
            return spec(**hyper)
        except ConfigError as e:
            raise ConfigError(
                f"tiermem: DeepSpeed config optimizer block: {str(e).removeprefix('tiermem: ')}"
            ) from None

    return read


#: DeepSpeed optimizer types tiermem runs (lowercase; the config's in any case), each with the
#: reader of its ``params`` block into a tiermem spec: one row per optimizer (DeepSpeed's CPU
#: Adagrad and Lion defaults for what a block leaves out)
OPTIMIZER_BLOCKS = {
    "adam": _adam_block,
    "adamw": _adam_block,
    "adagrad": _plain_block(Adagrad, {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0}),
    "lion": _plain_block(Lion, {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}),
}


def _offload(r: _Reader, zero: Mapping, key: str) -> tuple[Tier, Optional[str]]:
    block = _block(zero, key, "zero_optimization.")
    where = f"zero_optimization.{key}"
    device = block.get("device", "none")
    if device not in _DEVICES:
        raise ConfigError(
            f'tiermem: DeepSpeed config {where}.device={_short(device)} is invalid: it must be "none", "cpu" or "nvme"'
        )
    path = block.get("nvme_path")
    for k, v in block.items():
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


def _policy(r: _Reader, cfg: Mapping) -> tuple[Policy, Optional[str]]:
    zero = _block(cfg, "zero_optimization", "")
    stage = zero.get("stage", 0)
    if not is_int(stage) or stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"tiermem: DeepSpeed config zero_optimization.stage={_short(stage)} is invalid: it must be 0, 1, 2 or 3"
        )
    for old in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        if old in zero:
            raise ConfigError(
                f"tiermem: DeepSpeed config zero_optimization.{old} is DeepSpeed's deprecated form; "
                f'write offload_optimizer / offload_param: {{"device": "cpu"}} instead'
            )
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
        "zero_optimization.offload_*.nvme_path", params_path or state_path or _ABSENT, "nvme_dir", default=None
    )
    grads = Tier.DEVICE if state is Tier.DEVICE else Tier.HOST  # ZeRO-Offload: fp32 grads where Adam runs
    return _placement(
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


def _placement(homes: dict[TensorClass, Tier]) -> Policy:
    from tiermem.policies import KeepOnDevice, ZeroInfinity, ZeroOffload  # lazy: policies import tiermem

    for builtin in (ZeroOffload, ZeroInfinity, KeepOnDevice):
        if dict(builtin.homes) == homes:
            return builtin()
    return OffloadPolicy(homes)


def _batch(r: _Reader, cfg: Mapping) -> None:
    """Batch sizes and accumulation are the training loop's: checked against the keywords when
    given (the Trainer passes its own), otherwise reported as the loop's business."""
    for key, why in _LOOP.items():
        if key not in cfg:
            continue
        if key in r.overrides:
            r.take(key, cfg[key], key)
        elif cfg[key] != "auto":
            r.note(key, cfg[key], why)


def read_config(config: Any) -> dict:
    """A DeepSpeed config as a dict: from a JSON file, or a deep copy of the dict given."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a deep copy, and a check that it is JSON
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"tiermem: from_deepspeed_config needs a path to a DeepSpeed JSON file or a dict, got "
            f"{type(config).__name__}"
        )
    try:
        with open(config) as f:
            cfg = json.load(f)
    except OSError as e:
        raise ConfigError(
            f"tiermem: cannot read the DeepSpeed config {str(config)!r}: {e.strerror}; "
            f"pass the path of an existing JSON file"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"tiermem: the DeepSpeed config {str(config)!r} is not valid JSON (line {e.lineno}, "
            f"column {e.colno}: {e.msg}); fix the file"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"tiermem: the DeepSpeed config {str(config)!r} is not a JSON object; it must be {{...}}")
    return cfg


def translate(config: Any, **overrides: Any) -> tuple[dict[str, Any], list[str]]:
    """The TieredModel keyword arguments a DeepSpeed config (path or dict) means, and one line per
    key not honoured (NOTE [DeepSpeed config]). ``overrides``: :data:`CONFIG_KEYWORDS` fill
    "auto" and must agree with the config; :data:`PASS_THROUGH` go to TieredModel as they are."""
    bad = sorted(set(overrides) - set(CONFIG_KEYWORDS) - set(PASS_THROUGH))
    if bad:
        raise ConfigError(
            f"tiermem: from_deepspeed_config got unexpected keyword arguments {bad}; it takes "
            f"{', '.join(CONFIG_KEYWORDS + PASS_THROUGH)} (the config gives policy and optimizer)"
        )
    cfg = read_config(config)
    r = _Reader(overrides)
    precision = _precision(r, cfg)
    policy, nvme_dir = _policy(r, cfg)
    clip = r.take(
        "gradient_clipping",
        cfg.get("gradient_clipping", _ABSENT),
        "grad_clip",
        default=None,
        norm=lambda v: None if v == 0 else v,
    )
    if clip is not None and (not is_number(clip) or not clip > 0 or math.isinf(clip)):
        raise ConfigError(
            f"tiermem: DeepSpeed config gradient_clipping={_short(clip)} is invalid: it must be a "
            f"number >= 0 (0: no clipping)"
        )
    _batch(r, cfg)
    options: dict[str, Any] = dict(
        policy=policy, optimizer=_optimizer(r, cfg), precision=precision, grad_clip=clip, nvme_dir=nvme_dir
    )
    if precision == "fp16":
        options["loss_scale"] = _loss_scale(r, cfg)
    handled = {"bf16", "bfloat16", "fp16", "zero_optimization", "gradient_clipping", "optimizer", *_LOOP}
    for key, value in cfg.items():
        if key not in handled:
            r.note(key, value, _TOP_IGNORED.get(key, _NONE))
    options.update({k: v for k, v in overrides.items() if k in PASS_THROUGH and k not in ("no_decay", "no_decay_1d")})
    return options, r.notes


def from_deepspeed_config(model: torch.nn.Module, config: Any, **overrides: Any) -> TieredModel:
    """A :class:`~tiermem.TieredModel` of ``model`` as the DeepSpeed config ``config`` describes it;
    logs one warning line per key tiermem does not honour, saying why and what it does instead
    (NOTE [DeepSpeed config]).

    Args:
        model: the ``torch.nn.Module`` to train.
        config: a DeepSpeed config: a path to its JSON file, or the dict.
        **overrides: values for the config's ``"auto"`` entries (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``precision``, ``grad_clip``, ``nvme_dir``, ...; one that contradicts a
            value the config sets is an error), and options passed to TieredModel as they are
            (``budgets``, ``device``, ``bucket_size``, ...).

    Returns:
        The TieredModel, built.
    """
    options, notes = translate(config, **overrides)
    for line in notes:
        log.warning("%s", line)
    return TieredModel(model, **options)
