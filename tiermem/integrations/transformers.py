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
names tiermem runs: ``OPTIM_NAMES`` in :mod:`tiermem.integrations.hf_args`, which reads the
arguments), the config's optimizer block, ``optimizer_cls_and_kwargs=(cls, kwargs)`` or
``optimizers=(optimizer, scheduler)`` (a torch optimizer as ``TieredModel(optimizer=...)`` takes
it, and an lr scheduler built on it, which is moved onto tiermem's optimizer).

# NOTE [Trainer integration]
The Trainer keeps its loop (data, gradient accumulation, lr scheduler, logging, evaluation,
``save_steps``, resume); tiermem comes in through the extension points the Trainer documents
for subclasses, and two private methods of transformers 5 where no public hook exists
(``_wrap_model``: what wraps the model for distributed training; ``_load_best_model``):

- ``create_optimizer`` wraps the model in a TieredModel (its optimizer: a name of ``OPTIM_NAMES``
  with the arguments' hyperparameters and the Trainer's weight-decay groups,
  ``optimizer_cls_and_kwargs`` built on those same groups, or the optimizer of ``optimizers=``,
  each read as :mod:`tiermem.config.torch_optim` reads a torch optimizer; a scheduler of ``optimizers=``
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

import json
import logging
import os
from typing import Any, Optional, cast

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tiermem.errors import ConfigError, TierMemError
from tiermem.integrations.deepspeed.walk import translate
from tiermem.integrations.hf_args import (
    built_named,
    check_supported,
    given_optimizer,
    has_optimizer_block,
    move_scheduler,
    named_spec,
    precision_of,
    tiermem_options,
    trainer_arguments,
)
from tiermem.integrations.hf_loop import TIERMEM_CHECKPOINT, SkipAwareOptimizer, TrainerModule, TrainerOptimizer
from tiermem.model.tiered_model import TieredModel

log = logging.getLogger(__name__)

__all__ = ["TieredTrainer", "TrainerOptimizer", "SkipAwareOptimizer", "TrainerModule", "TIERMEM_CHECKPOINT"]

#: what a finished checkpoint-N/ holds: tiermem's state, and the Trainer's, which it writes last
_COMPLETE = (TIERMEM_CHECKPOINT, TRAINER_STATE_NAME)


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
        check_supported(targs, kwargs)
        # the optimizer given (built on the module's parameters) becomes the TieredModel's at create_optimizer;
        # the Trainer holds none until then, only the scheduler built on it
        self.user_optimizer: Optional[torch.optim.Optimizer]
        self.user_optimizer, scheduler = kwargs.pop("optimizers", None) or (None, None)
        if self.user_optimizer is not None:
            kwargs["optimizers"] = (None, scheduler)
        self.user_optimizer_cls_and_kwargs = kwargs.pop("optimizer_cls_and_kwargs", None)
        self.tiermem_options = tiermem_options(tiermem, deepspeed)
        self.deepspeed_config, self.user_args = deepspeed, targs
        self.tiered: Optional[TieredModel] = None
        self.tiered_optimizer: Optional[TrainerOptimizer] = None
        self._resume: Optional[str] = None  # the checkpoint folder train() resumes from
        if "args" in kwargs:
            kwargs["args"] = trainer_arguments(targs)
        else:
            args = (args[0], trainer_arguments(targs), *args[2:])
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
                move_scheduler(self.lr_scheduler, self.user_optimizer, self.optimizer)
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
        given = given_optimizer(
            model,
            decay,
            optimizer=self.user_optimizer,
            cls_and_kwargs=self.user_optimizer_cls_and_kwargs,
            weight_decay=a.weight_decay,
        )
        if self.deepspeed_config is None:
            optimizer = given if given is not None else built_named(a, hyper, no_decay)
            return TieredModel(model, optimizer=optimizer, precision=precision_of(a), grad_clip=grad_clip, **placed)
        if given is None and not has_optimizer_block(self.deepspeed_config):
            named_spec(a)  # the arguments' optim= must be one tiermem runs: the config has none
        options, notes = translate(
            self.deepspeed_config,
            **hyper,
            precision=precision_of(a),
            grad_clip=grad_clip,
            no_decay=no_decay,
            train_micro_batch_size_per_gpu=a.per_device_train_batch_size,
            gradient_accumulation_steps=a.gradient_accumulation_steps,
            train_batch_size=a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size,
            **placed,
        )
        if given is not None:
            if has_optimizer_block(self.deepspeed_config):
                raise ConfigError(
                    "tiermem: TieredTrainer got an optimizer (optimizers= or optimizer_cls_and_kwargs=) "
                    "and a DeepSpeed config with an optimizer block; drop one of them"
                )
            options["optimizer"] = given
        for line in notes:
            log.warning("%s", line)
        return TieredModel(model, **options)

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
