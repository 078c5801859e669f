"""What a TieredModel holds for its life, and how it gives it back: after detach(), after a
construction that failed, and when nothing references it any more.

# NOTE [A dropped model lets go]
A TieredModel owns threads (the engine's lanes, the NVMe store's I/O), pooled and pinned host
memory, NVMe files and the NVMe directory's lock. detach() gives them back; so does dropping the
last reference to the model: nothing the model builds refers back to it (the hooks on the user's
module reach its collaborators, never the TieredModel; tm.optimizer refers to it weakly), and a
finalizer on it has the release worker (NOTE [Finalizers only enqueue] in
:mod:`tiermem.memory.deferred`) remove the hooks (the module no longer reaches anything of
tiermem's), close the engine (its threads end), and delete every stored key and free the pools
(files, pinned memory and the lock go), soon after. The module keeps what its parameters
hold at that moment (working-precision weights; those homed off the device raise a ``tiermem:``
error when read): detach() is the way to get the trained fp32 weights back, and a model dropped after it
trained says so in the log (at INFO: a script whose model lives in a function drops it too). A
new TieredModel, and an NVMe store that finds its directory locked by this process, first
collect garbage and wait for the worker (``deferred.collect``).

A process forked from one holding a model (a DataLoader worker, a fork-started helper) holds a
copy of it that shares the parent's files and lock: when that copy is dropped in the child, it
gives nothing back, and nothing the parent had deferred runs there.

Two more ends are kept as clean. A construction that raises once the stores exist (a disk that
fills while the first weights are written) puts back the tensors the module's parameters and
buffers held, removes its hooks and gives everything back before the error propagates
(:func:`undone_on_failure`). And a module (or any module in it, or around it) belongs to one live
TieredModel at a time (:func:`check_unowned`): a second one would hook the same parameters and
each would take the other's gradients, so it is refused until the first is detached or dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from tiermem.errors import ConfigError
from tiermem.memory import deferred
from tiermem.model.phase import Phase
from tiermem.train.weights.offdevice import point

if TYPE_CHECKING:
    from tiermem.observe.trace import Tracer
    from tiermem.train.hooks import HookSet
    from tiermem.train.step.stepper import Stepper
    from tiermem.transfer.engine import TransferEngine

log = logging.getLogger(__name__)

#: every module (and submodule) a live TieredModel wraps -> that model, weakly
_OWNERS: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def dropped(
    hooks: HookSet, engine: TransferEngine, stores: dict, tracer: Tracer, stepper: Stepper, pid: Optional[int] = None
) -> None:
    """The finalizer of a TieredModel built in process ``pid``: its :func:`give_back`, deferred
    (NOTE [Finalizers only enqueue] in :mod:`tiermem.memory.deferred`). In a forked child, the
    copy of a parent's model gives nothing back: its files and lock are the parent's."""
    if pid is not None and pid != os.getpid():
        return
    deferred.defer(_give_back_now, hooks, engine, stores, tracer, stepper)


def give_back(hooks: HookSet, engine: TransferEngine, stores: dict, tracer: Tracer) -> None:
    """Everything a TieredModel holds, given back now (detach(); NOTE [A dropped model lets go])."""
    _give_back_now(hooks, engine, stores, tracer, None)


def _give_back_now(
    hooks: HookSet, engine: TransferEngine, stores: dict, tracer: Tracer, stepper: Optional[Stepper]
) -> None:
    if stepper is not None and stepper.steps:
        log.info(
            "tiermem: a TieredModel trained for %d steps was dropped without detach(): its memory, files "
            "and lock were given back with its trained weights (its module holds working-precision "
            "weights; those that lived off the device raise an error when read); call tm.detach() or tm.save(path) "
            "before dropping a model whose weights you need",
            stepper.steps,
        )
    errors = []
    for step in (hooks.remove, engine.close, *(s.release_all for s in stores.values()), tracer.write):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - give back the rest first, then tell
            errors.append(e)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def undone_on_failure(parts: Any, module: torch.nn.Module) -> Iterator[None]:
    """TieredModel's construction once its stores exist: if it raises, the module gets back the
    tensors its parameters and buffers held and loses the hooks put on it, and the engine's
    threads and the stores' memory, files and lock are given back, before the error propagates.
    ``parts``: what construction built so far (:class:`tiermem.model.build.Parts`: its stores, and
    its hooks, engine and off-device weights once they exist)."""
    params = [(p, p.data) for p in module.parameters()]
    buffers = [(owner, name, buf) for owner in module.modules() for name, buf in owner._buffers.items()]
    try:
        yield
    except BaseException:
        for attr in ("param_offload", "gathered"):
            source = getattr(parts, attr, None)
            if source is not None:
                source.undo()  # off-device weights become the plain tensors they were
        for p, data in params:
            point(p, data)  # a parameter of a meta model gets its meta tensor back
        for owner, name, buf in buffers:
            owner._buffers[name] = buf
        hooks, engine = getattr(parts, "hooks", None), getattr(parts, "engine", None)
        steps = [hooks.remove] if hooks is not None else []
        steps += [engine.close] if engine is not None else []
        for step in steps + [s.release_all for s in parts.stores.values()]:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the construction's own error is the one to see
                log.warning("tiermem: while undoing a failed TieredModel(...): %s: %s", type(e).__name__, e)
        raise


def claim(module: torch.nn.Module, tm: Any) -> None:
    """``tm`` wraps ``module`` and every module in it, until :func:`disown` or its collection."""
    for m in module.modules():
        _OWNERS[m] = weakref.ref(tm)


def disown(module: torch.nn.Module, tm: Any) -> None:
    for m in module.modules():
        ref = _OWNERS.get(m)
        if ref is not None and ref() is tm:
            del _OWNERS[m]


def check_unowned(module: torch.nn.Module) -> None:
    """Refuse a module that a live TieredModel already wraps, wholly or in part: both would hook
    its parameters, and each would see the other's gradients (NOTE [A dropped model lets go])."""
    found = _owner(module)
    if found is not None:
        del found
        deferred.collect()  # a model that only a reference cycle keeps lets go
        found = _owner(module)
    if found is not None:
        name, tm = found
        what = f"its submodule {name!r}" if name else "it"
        raise ConfigError(
            f"tiermem: this {type(module).__name__} cannot be wrapped: a live TieredModel already wraps "
            f"{what} ({tm!r}); call tm.detach() on that one, or drop every reference to it "
            f"(del tm), before wrapping the module again"
        )


def _owner(module: torch.nn.Module) -> Optional[tuple[str, Any]]:
    for name, m in module.named_modules():
        ref = _OWNERS.get(m)
        tm = ref() if ref is not None else None
        if tm is not None and tm.phase is not Phase.DETACHED:
            return name, tm
    return None
