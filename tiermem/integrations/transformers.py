"""The Hugging Face ``Trainer`` on tiermem: :class:`TieredTrainer`.

Coming from DeepSpeed, two lines change: the import, and where the DeepSpeed config goes (to
the trainer instead of ``TrainingArguments``)::

    from tiermem.integrations.transformers import TieredTrainer
    args = TrainingArguments("out", bf16=True, gradient_accumulation_steps=4, max_grad_norm=1.0, save_steps=500)
    trainer = TieredTrainer(model=model, args=args, train_dataset=ds, deepspeed="ds.json")
    trainer.train()                     # later: trainer.train(resume_from_checkpoint=True)

Without a DeepSpeed config, ``tiermem={...}`` gives TieredModel's own options
(``policy=``, ``nvme_dir=``, ``budgets=``, ...); precision and clipping always come from
``TrainingArguments`` (and the config), the optimizer from ``TrainingArguments(optim=...)`` (the
names tiermem runs: :data:`OPTIM_NAMES`), the config's optimizer block,
``optimizer_cls_and_kwargs=(cls, kwargs)`` or ``optimizers=(optimizer, scheduler)`` (a torch
optimizer as ``TieredModel(optimizer=...)`` takes it, and an lr scheduler built on it, which is
moved onto tiermem's optimizer).

# NOTE [Trainer integration]
The Trainer keeps its loop (data, gradient accumulation, lr scheduler, logging, evaluation,
``save_steps``, resume); tiermem comes in through the extension points the Trainer documents
for subclasses, and two private methods of transformers 5 where no public hook exists
(``_wrap_model``: what wraps the model for distributed training; ``_load_best_model``):

- ``create_optimizer`` wraps the model in a TieredModel (its optimizer: a name of
  :data:`OPTIM_NAMES` with the arguments' hyperparameters and the Trainer's weight-decay groups,
  ``optimizer_cls_and_kwargs`` built on those same groups, or the optimizer of ``optimizers=``,
  each read as :mod:`tiermem.torch_optim` reads a torch optimizer; a scheduler of ``optimizers=``
  then drives tiermem's groups) and gives the Trainer a torch Optimizer
  (:class:`TrainerOptimizer`) whose param groups are tiermem's, so the Trainer's lr scheduler
  sets tiermem's lr, and whose ``step()`` is ``tm.step()`` (clipping to ``max_grad_norm`` inside).
  Accelerate gets it already prepared (:class:`SkipAwareOptimizer`, an ``AcceleratedOptimizer``)
  whose ``step_was_skipped`` is ``tm.step()``'s ``skipped``: the Trainer steps its lr scheduler
  only ``if not accelerator.optimizer_step_was_skipped``, so an fp16 step tiermem skips for
  overflow leaves the schedule where it was, as the Trainer's own GradScaler does.
- ``training_step``: ``compute_loss`` with the TieredModel as the model (the forward runs through
  ``tm(...)``), the Trainer's gradient-accumulation scaling rule, then ``tm.backward(loss)``.
  ``prediction_step`` (evaluation) forwards through ``tm(...)`` too.
- ``log``: the Trainer measures the grad norm from the module's ``.grad``, which tiermem has
  already moved to the gradients' home; the ``grad_norm`` logged is the one ``tm.step()``
  measured (before clipping, as the Trainer's is).
- ``save_model`` writes the fp32 master weights (``model.safetensors``, loadable with
  ``from_pretrained``), and inside a ``checkpoint-N/`` folder also ``tiermem.ckpt`` (``tm.save``:
  atomic, checksummed, optimizer state included; one file in one process, under torchrun a
  torch.distributed.checkpoint directory every rank writes its shards to). The Trainer's
  ``optimizer.pt`` then holds the param groups' hyperparameters and the step count, which
  resuming checks against tiermem.ckpt.
- ``train(resume_from_checkpoint=True)`` takes the newest *complete* ``checkpoint-N/`` (with
  ``tiermem.ckpt`` and ``trainer_state.json``, which the Trainer writes last): a run killed while
  saving resumes from the checkpoint before.
- ``TrainingArguments(bf16=True)`` / ``fp16=True`` is tiermem's precision: the weights are in that
  dtype themselves, so the Trainer gets a copy of the arguments with bf16/fp16 off (no autocast or
  GradScaler of its own on top) and ``place_model_on_device`` False (tiermem places the weights).

- The loop's model (``model_wrapped``) is a :class:`TrainerModule`, not the Trainer's
  ``self.model`` (``_wrap_model``), so accelerate prepares the data and the optimizer but wraps no
  DDP. Under torchrun (``world_size > 1``) the TieredModel shards over the default process group,
  which the Trainer joined; the data loader gives each rank its share; on the micro-batches before
  a step's last the Trainer enters the model's ``no_sync()``, which is ``tm.no_sync()``. The
  TieredModel's device is the Trainer's ``args.device`` (``cuda:<local rank>``, or the CPU with
  ``use_cpu``) unless ``tiermem={"device": ...}`` says otherwise. ``save_model`` runs on every
  rank (``state_dict()`` and ``tm.save`` are collectives); rank 0 writes model.safetensors, every
  rank its shards of ``tiermem.ckpt``. Called on rank 0 alone
  it waits for the others until the process group's timeout, then (gloo) raises a ``tiermem:``
  error naming the mistake. One process driving
  several GPUs is refused.

- ``load_best_model_at_end=True`` loads the best ``checkpoint-N/``'s ``tiermem.ckpt`` with
  ``tm.load`` (``_load_best_model``): weights, optimizer state and step are the best checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional, cast

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tiermem.config import AdamW, _Spec
from tiermem.optim_specs import SGD, Adagrad, AdamW8bit, Lion
from tiermem.deepspeed_config import PASS_THROUGH, read_config, translate
from tiermem.errors import ConfigError, TierMemError
from tiermem.integrations.hf_loop import TIERMEM_CHECKPOINT, SkipAwareOptimizer, TrainerModule, TrainerOptimizer
from tiermem.torch_optim import runs, spec_from_torch, supported_names
from tiermem.train.model import TieredModel

log = logging.getLogger(__name__)

__all__ = ["TieredTrainer", "TrainerOptimizer", "SkipAwareOptimizer", "TrainerModule", "TIERMEM_CHECKPOINT"]

#: the optimizers TrainingArguments(optim=...) may name, each with the tiermem spec that runs it
#: (built with those of the arguments' learning_rate, adam_beta1/2, adam_epsilon, weight_decay that
#: it takes, as the Trainer builds them: Lion takes the adam betas; and the Trainer's no-decay
#: group); one row per optimizer whose meaning tiermem's has (bitsandbytes' and torchao's 8-bit
#: AdamW are block-wise 8-bit moments; paged state is homed by the policy instead), any other name
#: (4-bit, 8-bit Lion, RMSprop, ...) is refused with this list
OPTIM_NAMES: dict[str, type[_Spec]] = {
    "adamw_torch": AdamW,
    "adamw_torch_fused": AdamW,
    "adamw_torch_xla": AdamW,
    "adamw_torch_npu_fused": AdamW,
    "paged_adamw_32bit": AdamW,
    "sgd": SGD,
    "adagrad": Adagrad,
    "lion_32bit": Lion,
    "paged_lion_32bit": Lion,
    "adamw_8bit": AdamW8bit,
    "adamw_bnb_8bit": AdamW8bit,
    "paged_adamw_8bit": AdamW8bit,
    "adamw_torch_8bit": AdamW8bit,
}
#: which of the arguments' hyperparameters the Trainer gives each (the Adams all of theirs; SGD and
#: Adagrad the lr and the groups' weight decay, their eps their own; Lion the adam betas too)
TRAINER_TAKES: dict[type, tuple[str, ...]] = {
    SGD: ("lr", "weight_decay"),
    Adagrad: ("lr", "weight_decay"),
    Lion: ("lr", "betas", "weight_decay"),
}
#: the ``optim_args`` keys the Trainer reads for an optimizer ("momentum=0.9,nesterov=True"), as it reads them
OPTIM_ARGS: dict[type, dict[str, Any]] = {
    SGD: {
        "momentum": float,
        "dampening": float,
        "weight_decay": float,
        "nesterov": lambda v: v.lower() in ("true", "1", "yes"),
    },
    Adagrad: {"lr_decay": float, "weight_decay": float, "eps": float},
}
#: what a finished checkpoint-N/ holds: tiermem's state, and the Trainer's, which it writes last
_COMPLETE = (TIERMEM_CHECKPOINT, TRAINER_STATE_NAME)


class _NoPlacementArguments:
    """Mixed into the Trainer's copy of the arguments: tiermem places the weights (the override
    the Trainer documents for integrations that do)."""

    @property
    def place_model_on_device(self) -> bool:
        return False


def _trainer_arguments(args: TrainingArguments) -> TrainingArguments:
    """The user's arguments with bf16/fp16 off and no device placement (NOTE [Trainer integration])."""
    cls = type(f"Tiered{type(args).__name__}", (_NoPlacementArguments, type(args)), {})
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return cls(**{**values, "bf16": False, "fp16": False})


def _precision(args: TrainingArguments) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


class TieredTrainer(Trainer):
    """A ``transformers.Trainer`` that trains through a :class:`tiermem.TieredModel` (NOTE
    [Trainer integration]). After ``train()`` starts, ``trainer.tiered`` is the TieredModel.

    Args:
        *args: as ``transformers.Trainer`` takes them (``model``, ``args``, ...).
        deepspeed: a DeepSpeed config (path or dict) read by :func:`tiermem.from_deepspeed_config`,
            its ``"auto"`` values taken from ``args``; give it here, not to ``TrainingArguments``.
        tiermem: more TieredModel options (``policy``, ``nvme_dir``, ``budgets``, ``device``, ...);
            with a DeepSpeed config only those the config has no say in.
        **kwargs: as ``transformers.Trainer`` takes them; ``optimizers=(optimizer, scheduler)`` takes
            a torch optimizer built on the model's parameters, as ``TieredModel(optimizer=...)`` does.
    """

    def __init__(self, *args: Any, deepspeed: Any = None, tiermem: Optional[dict] = None, **kwargs: Any):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if not isinstance(targs, TrainingArguments):
            raise ConfigError(
                "tiermem: TieredTrainer needs args=TrainingArguments(...) (its learning rate, "
                "precision and clipping are tiermem's too)"
            )
        _check_supported(targs, kwargs)
        # the optimizer given (built on the module's parameters) becomes the TieredModel's at create_optimizer;
        # the Trainer holds none until then, only the scheduler built on it
        self.user_optimizer: Optional[torch.optim.Optimizer]
        self.user_optimizer, scheduler = kwargs.pop("optimizers", None) or (None, None)
        if self.user_optimizer is not None:
            kwargs["optimizers"] = (None, scheduler)
        self.user_optimizer_cls_and_kwargs = kwargs.pop("optimizer_cls_and_kwargs", None)
        self.tiermem_options = _tiermem_options(tiermem, deepspeed)
        self.deepspeed_config, self.user_args = deepspeed, targs
        self.tiered: Optional[TieredModel] = None
        self.tiered_optimizer: Optional[TrainerOptimizer] = None
        self._resume: Optional[str] = None  # the checkpoint folder train() resumes from
        if "args" in kwargs:
            kwargs["args"] = _trainer_arguments(targs)
        else:
            args = (args[0], _trainer_arguments(targs), *args[2:])
        super().__init__(*args, **kwargs)

    # -- the optimizer: a TieredModel ------------------------------------------------------------
    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        """Wrap the model in its TieredModel (once) and return ``trainer.tiered.optimizer``, which
        the Trainer's lr scheduler drives.

        Args:
            model: unused; the Trainer's own model is wrapped.
        """
        if self.optimizer is None:
            assert self.model is not None  # the Trainer was given one (model_init made it before)
            self.tiered = self._wrap(self.model)
            if self.tiered.group.world != self.args.world_size:
                raise ConfigError(
                    f"tiermem: this Trainer runs {self.args.world_size} processes but the TieredModel "
                    f"shards over {self.tiered.group.world}; leave process_group out of tiermem= (the "
                    f"default group is the Trainer's)"
                )
            self.tiered_optimizer = TrainerOptimizer(self.tiered)
            self.optimizer = SkipAwareOptimizer(self.tiered_optimizer)
            if self.user_optimizer is not None and self.lr_scheduler is not None:
                _move_scheduler(self.lr_scheduler, self.user_optimizer, self.optimizer)
            if self._resume is not None:
                self.tiered.load(os.path.join(self._resume, TIERMEM_CHECKPOINT))
        return self.optimizer

    def _wrap(self, model: torch.nn.Module) -> TieredModel:
        a = self.user_args
        decay = set(self.get_decay_parameter_names(model))
        no_decay = tuple(n for n, p in model.named_parameters() if p.requires_grad and n not in decay)
        grad_clip = a.max_grad_norm if a.max_grad_norm and a.max_grad_norm > 0 else None
        hyper: dict[str, Any] = dict(
            lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, weight_decay=a.weight_decay
        )
        placed = {"device": self.args.device, **self.tiermem_options}  # the Trainer's (cuda:<local rank>, use_cpu)
        given = self._given_optimizer(model, decay)
        if self.deepspeed_config is None:
            optimizer = given if given is not None else self._built_named(hyper, no_decay)
            return TieredModel(model, optimizer=optimizer, precision=_precision(a), grad_clip=grad_clip, **placed)
        if given is None and not _has_optimizer_block(self.deepspeed_config):
            self._named_optimizer()  # the arguments' optim= must be one tiermem runs: the config has none
        options, notes = translate(
            self.deepspeed_config,
            **hyper,
            precision=_precision(a),
            grad_clip=grad_clip,
            no_decay=no_decay,
            train_micro_batch_size_per_gpu=a.per_device_train_batch_size,
            gradient_accumulation_steps=a.gradient_accumulation_steps,
            train_batch_size=a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size,
            **placed,
        )
        if given is not None:
            if _has_optimizer_block(self.deepspeed_config):
                raise ConfigError(
                    "tiermem: TieredTrainer got an optimizer (optimizers= or optimizer_cls_and_kwargs=) "
                    "and a DeepSpeed config with an optimizer block; drop one of them"
                )
            options["optimizer"] = given
        for line in notes:
            log.warning("%s", line)
        return TieredModel(model, **options)

    def _built_named(self, hyper: dict[str, Any], no_decay: tuple[str, ...]) -> _Spec:
        """The spec of ``optim=`` with the arguments' hyperparameters it takes, and ``optim_args``."""
        spec = self._named_optimizer()
        taken = TRAINER_TAKES.get(spec, spec.HYPER)
        kwargs = {k: v for k, v in hyper.items() if k in taken}
        given = self.user_args.optim_args
        if given and spec in OPTIM_ARGS:
            pairs = dict(x.split("=", 1) for x in given.replace(" ", "").split(",") if "=" in x)
            kwargs.update({k: read(pairs[k]) for k, read in OPTIM_ARGS[spec].items() if k in pairs})
        return spec(**kwargs, no_decay=no_decay)

    def _named_optimizer(self) -> type[_Spec]:
        """The spec of ``TrainingArguments(optim=...)``, by :data:`OPTIM_NAMES`."""
        optim = getattr(self.user_args.optim, "value", self.user_args.optim)  # an OptimizerNames (a str enum) or a str
        if optim == "adafactor":  # the Trainer's name builds transformers' Adafactor, another update than torch's
            raise ConfigError(
                "tiermem: TrainingArguments(optim='adafactor') is transformers' Adafactor with an absolute "
                "step size (relative_step=False, scale_parameter=False), which tiermem does not run; "
                "tiermem runs torch.optim.Adafactor (a step relative to the weights' RMS, other numbers): "
                "pass TieredTrainer(optimizer_cls_and_kwargs=(torch.optim.Adafactor, {'lr': ...})) to "
                "train with it"
            )
        if optim not in OPTIM_NAMES:
            raise ConfigError(
                f"tiermem: TrainingArguments(optim={optim!r}) is not an optimizer tiermem runs; it runs "
                f"{', '.join(repr(n) for n in OPTIM_NAMES)} (the default is 'adamw_torch_fused')"
            )
        return OPTIM_NAMES[optim]

    def _given_optimizer(self, model: torch.nn.Module, decay: set[str]) -> Any:
        """The optimizer of ``optimizers=`` or one built as the Trainer builds
        ``optimizer_cls_and_kwargs`` (its weight-decay groups), or None."""
        if self.user_optimizer is not None:  # its scheduler, if any, moves onto tiermem's groups (_move_scheduler)
            return spec_from_torch(self.user_optimizer, scheduled=True)
        if self.user_optimizer_cls_and_kwargs is None:
            return None
        cls, kwargs = self.user_optimizer_cls_and_kwargs
        if not runs(cls) and not (isinstance(cls, type) and issubclass(cls, _Spec)):
            raise ConfigError(
                f"tiermem: TieredTrainer(optimizer_cls_and_kwargs=({getattr(cls, '__name__', cls)}, ...)) "
                f"is not an optimizer tiermem runs; it runs {supported_names()} and tiermem's specs fused, "
                f"any other torch.optim.Optimizer generically"
            )
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.user_args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        return cls(groups, **dict(kwargs))

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        """Once the TieredModel exists, the loop's model is :class:`TrainerModule`: not the
        Trainer's ``self.model``, so accelerate prepares the optimizer and data only (no DDP)."""
        if self.tiered is None:
            return super()._wrap_model(model, training, dataloader)
        return TrainerModule(self.tiered)

    # -- a step: forward and backward through the TieredModel -------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch: forward through the TieredModel and ``tm.backward`` of its loss (divided
        by the accumulation steps unless the Trainer already did; the Trainer enters ``tm.no_sync()``
        for all but a step's last micro-batch); returns the loss, detached.

        Args:
            model: the model the Trainer passes (the TieredModel's module).
            inputs: the batch.
            num_items_in_batch: the Trainer's count of items for loss normalisation.
        """
        tm = self.tiered
        assert tm is not None  # create_optimizer made it, before the first step
        tm.train()
        with self.compute_loss_context_manager():
            loss = cast(
                torch.Tensor,
                self.compute_loss(
                    tm,  # type: ignore[arg-type]  # called like a Module
                    inputs,
                    num_items_in_batch=num_items_in_batch,
                ),
            )  # the loss alone
        del inputs
        scaled = self.loss_is_scaled_for_ga  # the Trainer's rule: is the loss already a share of the step's?
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        tm.backward(loss)
        return loss.detach()

    def prediction_step(
        self, model: torch.nn.Module, inputs: dict, prediction_loss_only: bool, ignore_keys: Optional[list[str]] = None
    ):
        return super().prediction_step(
            self.tiered if self.tiered is not None else model,  # type: ignore[arg-type]
            inputs,
            prediction_loss_only,
            ignore_keys=ignore_keys,
        )

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        last = self.tiered_optimizer.last if self.tiered_optimizer is not None else None
        if last is not None and "grad_norm" in logs:
            logs["grad_norm"] = last.grad_norm  # what tm.step() measured (NOTE [Trainer integration])
            if self.tiered is not None and self.tiered.precision == "fp16":
                logs["loss_scale"] = last.loss_scale
        super().log(logs, start_time)

    # -- checkpoints ----------------------------------------------------------------------------
    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint-N/'s ``tiermem.ckpt`` through ``tm.load``
        (weights, optimizer state and step; a collective under torchrun), never its
        model.safetensors into the module behind tiermem's back."""
        if self.tiered is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        assert best is not None  # the Trainer calls this once it tracked a best checkpoint
        path = os.path.join(best, TIERMEM_CHECKPOINT)
        if not os.path.exists(path):
            raise TierMemError(
                f"tiermem: the best checkpoint {best!r} (by {self.args.metric_for_best_model}) has no "
                f"{TIERMEM_CHECKPOINT}; it was not saved by a TieredTrainer: load it with "
                f"from_pretrained, or train without load_best_model_at_end"
            )
        log.info(
            "tiermem: loading the best model from %s (%s %s)",
            path,
            self.args.metric_for_best_model,
            self.state.best_metric,
        )
        self.tiered.load(path)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest *complete*
        ``checkpoint-N/`` (one whose save did not finish is skipped with a warning).

        Args:
            resume_from_checkpoint: a checkpoint folder, True for the newest complete one, or None.
            *args: passed to ``Trainer.train``.
            **kwargs: passed to ``Trainer.train``.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(_output_dir(self.args.output_dir))
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if resume_from_checkpoint is not None:
            if self.tiered is not None:
                raise TierMemError(
                    "tiermem: this TieredTrainer has trained already; resume from a checkpoint with "
                    "a new TieredTrainer (and a fresh model)"
                )
            missing = [f for f in _COMPLETE if not os.path.exists(os.path.join(resume_from_checkpoint, f))]
            if missing:
                raise TierMemError(
                    f"tiermem: {str(resume_from_checkpoint)!r} has no {' or '.join(missing)} (not "
                    f"saved by a TieredTrainer, or its save did not finish); resume from another "
                    f"checkpoint-N folder"
                )
        self._resume = resume_from_checkpoint
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._resume = None

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The fp32 master weights, loadable with ``from_pretrained``; in a checkpoint folder
        also tiermem's own checkpoint (NOTE [Trainer integration]).

        Under torchrun this is a collective (it gathers the weights, and ``tm.save`` is one too):
        call it on every rank, as with DeepSpeed or FSDP, never under ``if
        trainer.is_world_process_zero()``. Called on some ranks only, it waits for the others
        until the process group's timeout (``TrainingArguments(ddp_timeout=...)``, 1800 s by
        default); then, on gloo, it raises a ``tiermem:`` error that says so (NCCL's watchdog
        ends the process with its own message instead).

        Args:
            output_dir: the folder to write to (default: ``args.output_dir``).
            _internal_call: the Trainer's own flag, passed on as it gives it.
        """
        if self.tiered is None:
            return super().save_model(output_dir, _internal_call)
        try:
            self._save_model(output_dir, _internal_call)
        except TierMemError as e:
            if self.tiered.group.world > 1 and "timed out" in str(e).lower():
                raise TierMemError(
                    f"tiermem: save_model() waited for the other ranks past the process group's "
                    f"timeout: under torchrun it is a collective (it gathers the weights), so call "
                    f"it on every rank, not under `if trainer.is_world_process_zero()` "
                    f"({str(e).removeprefix('tiermem: ')})"
                ) from e
            raise

    def _save_model(self, output_dir: Optional[str], _internal_call: bool) -> None:
        output_dir = _output_dir(output_dir if output_dir is not None else self.args.output_dir)
        tm = self.tiered
        assert tm is not None  # save_model() goes the Trainer's way without one
        weights = tm.state_dict()
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            if hasattr(self.model, "save_pretrained"):
                dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
                self.model.save_pretrained(output_dir, state_dict=weights)  # type: ignore[union-attr, operator]
                _record_dtype(output_dir, dtypes)
            else:
                from safetensors.torch import save_file

                save_file(
                    {k: v.contiguous() for k, v in weights.items()},
                    os.path.join(output_dir, "model.safetensors"),
                    metadata={"format": "pt"},
                )
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.user_args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if _internal_call:
            tm.save(os.path.join(output_dir, TIERMEM_CHECKPOINT))


def _output_dir(output_dir: Optional[str]) -> str:
    assert output_dir is not None  # TrainingArguments always has one (default "trainer_output")
    return output_dir


def _record_dtype(output_dir: str, dtypes: set[torch.dtype]) -> None:
    """``save_pretrained`` records the module's dtype (tiermem's working precision) in
    config.json; the weights written are the fp32 masters, so record theirs, or ``from_pretrained``
    would load them rounded to the working precision."""
    path = os.path.join(output_dir, "config.json")
    if len(dtypes) != 1 or not os.path.isfile(path):
        return
    with open(path) as f:
        cfg = json.load(f)
    dtype = str(dtypes.pop()).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = dtype
    with open(path + ".tmp", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def last_complete_checkpoint(output_dir: str) -> str:
    """The newest ``checkpoint-N`` folder under ``output_dir`` that holds both tiermem's checkpoint
    and the Trainer's state (written last); newer incomplete ones are named in a warning."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        head, _, number = name.rpartition("-")
        if head == PREFIX_CHECKPOINT_DIR and number.isdigit() and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(number), os.path.join(output_dir, name)))
    for _, path in sorted(found, reverse=True):
        if all(os.path.exists(os.path.join(path, f)) for f in _COMPLETE):  # tiermem.ckpt: a file or a directory
            return path
        log.warning("tiermem: %s is incomplete (a save that did not finish?); resuming from an earlier one", path)
    raise TierMemError(
        f"tiermem: no complete checkpoint-N folder in {str(output_dir)!r} to resume from; train "
        f"without resume_from_checkpoint, or pass the folder"
    )


def _has_optimizer_block(config: Any) -> bool:
    if config is None:
        return False
    return "optimizer" in read_config(config)


def _tiermem_options(options: Optional[dict], deepspeed: Any) -> dict:
    options = dict(options or {})
    fixed = {"optimizer", "precision", "grad_clip", "no_decay", "no_decay_1d"} & set(options)
    if fixed:
        raise ConfigError(
            f"tiermem: TieredTrainer(tiermem={{{', '.join(sorted(fixed))}: ...}}): these come from "
            f"TrainingArguments (learning_rate, adam_*, weight_decay, bf16/fp16, max_grad_norm) and "
            f"the Trainer's get_decay_parameter_names(); set them there"
        )
    if deepspeed is not None:
        bad = sorted(set(options) - set(PASS_THROUGH) - {"nvme_dir"})
        if bad:
            raise ConfigError(
                f"tiermem: TieredTrainer(deepspeed=..., tiermem={{{', '.join(bad)}: ...}}): the "
                f"DeepSpeed config says these (where tensors live, loss scaling); drop them, or drop "
                f"deepspeed= and give TieredModel's options in tiermem="
            )
    return options


def _check_supported(args: TrainingArguments, kwargs: dict) -> None:
    if args.deepspeed:
        raise ConfigError(
            "tiermem: TrainingArguments(deepspeed=...) would start DeepSpeed itself; pass the config to "
            "TieredTrainer(..., deepspeed='ds.json') instead and leave it out of TrainingArguments"
        )
    if args.n_gpu > 1:
        raise ConfigError(
            f"tiermem: TieredTrainer drives one device per process ({args.n_gpu} GPUs are visible to "
            f"this one); run one process per GPU with torchrun --nproc_per_node {args.n_gpu}"
        )
    optimizer, _ = kwargs.get("optimizers") or (None, None)
    if optimizer is not None and kwargs.get("optimizer_cls_and_kwargs") is not None:
        raise ConfigError("tiermem: TieredTrainer got both optimizers= and optimizer_cls_and_kwargs=; give one")
    if optimizer is not None and not runs(type(optimizer)):
        raise ConfigError(
            f"tiermem: TieredTrainer(optimizers=({type(optimizer).__name__}(...), ...)) is not an "
            f"optimizer tiermem runs; it runs {supported_names()} fused and any other torch.optim.Optimizer "
            f"generically, built on the model's parameters"
        )


def _move_scheduler(scheduler: Any, given: torch.optim.Optimizer, tiered: torch.optim.Optimizer) -> None:
    """The lr scheduler of ``optimizers=(optimizer, scheduler)``, built on the torch optimizer
    tiermem read (and never steps), drives tiermem's groups instead: the same groups in the same
    order, each with the lr and initial_lr the scheduler set. Torch schedulers check that the
    optimizer's step is wrapped by one of them, and wrap it when they are built: a scheduler
    built on ``tiered`` and dropped does that, its lr then put back."""
    if getattr(scheduler, "optimizer", None) is not given:
        raise ConfigError(
            "tiermem: TieredTrainer(optimizers=(optimizer, scheduler)): the scheduler was not built on "
            "that optimizer; build it on the optimizer you pass with it"
        )
    if len(given.param_groups) != len(tiered.param_groups):
        raise TierMemError(
            "tiermem: the optimizer's param groups and tiermem's differ in number; pass param groups "
            "that hold the model's trainable parameters"
        )
    kept = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in given.param_groups]
    torch.optim.lr_scheduler.LambdaLR(tiered, lambda _: 1.0)  # wraps tiered.step as torch's schedulers expect
    for group, values in zip(tiered.param_groups, kept):
        group.update(values)
    scheduler.optimizer = tiered
