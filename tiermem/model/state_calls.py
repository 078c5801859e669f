"""TieredModel's calls that read or replace its state: ``state_dict``, ``save``, ``load``,
``save_pretrained``, the DCP pair ``sharded_state_dict`` / ``load_sharded_state_dict``, and
``detach`` (with ``with TieredModel(...) as tm:``, which detaches on the way out).

Each waits for an update in flight, checks the step's phase (NOTE [Step lifecycle]) and that no
failed step left weights of two steps (NOTE [A failed step is rolled forward]), then hands the
model's state (:class:`~tiermem.checkpoint.view.ModelState`) to :mod:`tiermem.checkpoint`.
:class:`~tiermem.TieredModel` has them as its own methods.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Self

import torch

from tiermem.checkpoint import file as checkpoint
from tiermem.checkpoint.save_pretrained import save_pretrained
from tiermem.checkpoint.view import ModelState
from tiermem.errors import ConfigError, TierMemError, add_note
from tiermem.memory import deferred
from tiermem.model import lifetime
from tiermem.model.inference import Inference
from tiermem.model.phase import Lifecycle, Phase
from tiermem.train.hooks import HookSet
from tiermem.train.layout import Layout
from tiermem.train.step.grads import GradCollector
from tiermem.train.step.stepper import Stepper
from tiermem.train.step.trainable import Trainable
from tiermem.transfer.collectives import Group


class StateCalls:
    """The state calls of :class:`~tiermem.TieredModel`, over the collaborators it holds."""

    module: torch.nn.Module
    group: Group
    stepper: Stepper
    grads: GradCollector
    _life: Lifecycle
    _state: ModelState
    _trainable: Trainable
    hooks: HookSet
    engine: Any
    stores: dict
    tracer: Any
    layout: Layout
    _release: Any
    _inference: Optional[Inference]  # NOTE [Inference only]: the parameters' flags to give back, or None

    weight_sources: Callable[[], list]  # TieredModel's: the homes of weights off the device

    def _settled(self, call: str, *, whole: bool = True) -> ModelState:
        """The model's state with nothing in flight, for the calls that read or replace it; with
        ``whole``, refused while a failed step left weights of two steps (NOTE [A failed step is
        rolled forward]): a read would keep the mix (a load replaces it: ``whole=False``)."""
        self._life.check("state", call)
        self.stepper.finish_pending()
        if whole:
            self.stepper.check_whole(f"tm.{call}")
        return self._state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights (and buffers) with the keys of ``module.state_dict()``."""
        state = self._settled("state_dict()")
        return state.module_state()

    def save_pretrained(
        self,
        directory: "str | os.PathLike[str]",
        *,
        max_shard_size: int | str = "2GiB",
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Write the weights as Hugging Face safetensors shards (and a transformers model's
        ``config.json``), read from their homes one tensor at a time (NOTE [Saving in the Hugging Face
        format]): ``transformers.AutoModel*.from_pretrained(directory)`` and
        ``TieredModel(..., weights=directory)`` read them back. A peft model's active adapter is
        written as peft's ``save_pretrained`` writes it (``adapter_model.safetensors`` and
        ``adapter_config.json``), the frozen base left unread.

        Args:
            directory: where to write; created if missing. An earlier save there is replaced (its
                shards and index), other files are left alone; a failed save changes nothing.
            max_shard_size: the largest shard, an int or a string such as ``"2GiB"``.
            dtype: the dtype of the floating-point weights written; default: the fp32 master weights.
        """
        state = self._settled("save_pretrained()")
        if self.group.world > 1:
            raise ConfigError(
                "tiermem: save_pretrained() is for one process in this version; under data parallelism save a "
                "checkpoint with tm.save(path), load it in one process with tm.load(path), and save_pretrained there"
            )
        save_pretrained(state, self.module, directory, max_shard_size=max_shard_size, dtype=dtype)

    def save(self, path: str, *, format: Optional[str] = None) -> None:
        """Checkpoint weights, optimizer state, loss scale and step to ``path``, atomically.

        The checkpoint is checksummed (xxh3_64 of every tensor), written beside ``path`` and renamed
        into place only when complete; state on NVMe is streamed bucket by bucket. Under data
        parallelism a collective: every rank calls it with the same path, on storage every rank sees.

        Args:
            path: the file or directory to write; an existing one is replaced whole.
            format: ``"file"``: one file (under data parallelism rank 0 writes it, gathered bucket by
                bucket); ``"dcp"``: a ``torch.distributed.checkpoint`` directory in which every rank
                writes its own shards, readable at any world size. Default: ``"dcp"`` under data
                parallelism, ``"file"`` in one process.
        """
        if format is None:
            format = "dcp" if self.group.world > 1 else "file"
        state = self._settled("save()")
        state.check_loaded("tm.save()")  # NOTE [A failed load is guarded]: nor of two checkpoints
        checkpoint.save(state, path, format)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This process's shards of the fp32 master weights and Adam moments, in a form
        ``torch.distributed.checkpoint`` saves and loads at any world size (NOTE [Sharded values
        for DCP]): ``{"model": {name: ...}, "optim": {"state": {name: {"exp_avg": ...,
        "exp_avg_sq": ...}}}, "tiermem": <step counts, loss scale, hyperparameters as JSON>}``.
        Values alias the model's state where it lives in memory; state that does not (on NVMe, a
        frozen base off the device or sharded over the ranks) is read from its home when DCP asks
        for it, a bucket at a time, and a ``dcp.load`` fills buffers of its own (NOTE [Streamed
        sharded values]). ``dcp.save(tm.sharded_state_dict(), checkpoint_id=d)`` writes a checkpoint
        (without tiermem's manifests, so ``tm.load(d)`` refuses it); ``sd = tm.sharded_state_dict();
        dcp.load(sd, checkpoint_id=d); tm.load_sharded_state_dict(sd)`` loads one. ``tm.state_dict()``
        stays the whole weights."""
        state = self._settled("sharded_state_dict()")
        state.check_loaded("tm.sharded_state_dict()")
        taken = self._state_now(state)

        def still() -> None:
            """What the call checked, when a dcp.save plans the dict; nothing collective (each rank
            plans on its own). Its step counts and hyperparameters are the call's: after a step, a
            load or a change of what trains they would go with other state."""
            call = "a dcp.save of tm.sharded_state_dict()"
            self._life.check("state", call)
            state.check_loaded(call)
            self.stepper.recovery.check_whole(call)
            now = self._state_now(state)
            if now != taken:
                since = ("stepped", "loaded a checkpoint", "frozen or unfrozen parameters")
                raise TierMemError(
                    f"tiermem: this tm.sharded_state_dict() was taken at step {taken[0]}, and the model has "
                    f"{next(w for w, a, b in zip(since, taken, now) if a != b)} since; its step counts would "
                    f"not match the state saved. Call tm.sharded_state_dict() again just before dcp.save"
                )

        return checkpoint.sharded_state_dict(state, still)

    def _state_now(self, state: ModelState) -> tuple[int, int, int]:
        """What a state dict's entries go with: the steps, loads and changes of the trainable set so far."""
        return self.stepper.steps, state.core.loads, self._trainable.changes

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what :meth:`sharded_state_dict` gave, filled by ``dcp.load``: the state, the
        working weights made from it, step counts, loss scale and hyperparameters (checked whole
        first). Under data parallelism a collective. Gradients waiting for a step are dropped.

        Args:
            state_dict: the dict :meth:`sharded_state_dict` returned, after ``dcp.load`` filled it.
        """
        checkpoint.load_sharded(self._settled("load_sharded_state_dict()", whole=False), state_dict)
        self.grads.drop()
        self._life.to(Phase.IDLE)

    def load(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save` (any bucket size, placement or world size;
        the same parameter names and param groups).

        Everything is checked (checksums, names, shapes, dtypes) before anything changes. Gradients
        waiting for a step (kept for the retry of a failed one) were computed with other weights:
        they are dropped, and the next step starts from the checkpoint alone. Under data
        parallelism a collective.

        Args:
            path: a file or DCP directory written by :meth:`save`.
        """
        state = self._settled("load()", whole=False)
        if self._inference is None:  # NOTE [Inference only]: requires_grad plays no part
            self._trainable.sync(grads_waiting=False, collective=True)  # parameters unfrozen before loading get state
        checkpoint.load(state, path)
        self.grads.drop()
        self._life.to(Phase.IDLE)

    def detach(self) -> torch.nn.Module:
        """Remove every hook and give the module back with fp32 weights (on the CPU, where the
        master weights were), ready for plain PyTorch."""
        state = self._settled("detach()")
        self._trainable.detachable()  # before anything changes (NOTE [The parameters a model was wrapped with])
        weights = state.fp32_weights()  # before the hooks go: frozen weights sharded over the ranks are gathered
        self.hooks.remove()
        for source in self.weight_sources():
            source.restore(weights)  # plain tensors again (NOTE [Parameters off the device])
        for name, p in self._trainable.wrapped:
            p.data = weights[name]
        self.layout.buffers.give_back()
        if self._inference is not None:
            self._inference.give_back()  # NOTE [Inference only]: requires_grad as it was given
        self._life.to(Phase.DETACHED)
        lifetime.disown(self.module, self)
        self._release.detach()  # the finalizer's own call would warn that the weights were not given back
        lifetime.give_back(self.hooks, self.engine, self.stores, self.tracer)
        return self.module

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``with TieredModel(module) as tm:`` detaches on the way out, so ``module`` holds the
        trained fp32 weights afterwards. If the block raised and the model cannot be detached
        (e.g. it stopped inside a hook), its memory, files and lock are still given back, and
        the block's error is the one raised."""
        if self._life.phase is Phase.DETACHED:
            return
        if exc_type is None:
            self.detach()
            return
        try:
            self.detach()
        except Exception as e:  # noqa: BLE001 - the block's own error is the one to see
            add_note(
                exc,
                f"tiermem: detach() on leaving the block failed too ({type(e).__name__}: {e}); the "
                f"model's memory, files and lock were given back; the module may not hold its trained weights",
            )
            self._life.to(Phase.DETACHED)
            self._release()  # runs once: says that the weights did not go back
            deferred.settle()
