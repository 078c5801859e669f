"""Where a parameter's first values come from when TieredModel builds its homes: the module's own
tensors (:class:`Given`), a checkpoint read one tensor at a time (:class:`FromCheckpoint`), or the
module's own initialization run one module at a time (:class:`FromInit`), for models built on the
meta device.

NOTE [Models on the meta device]
A module built under ``torch.device("meta")`` (or
``accelerate.init_empty_weights()``) has shapes and no values, so the plan is made from it as from
any other (nothing reads values before the homes are built) and each parameter gets its values
only when its bucket is built (:func:`tiermem.train.layout.build`): it is read or initialized into
a scratch tensor, copied into its master and working copy at their homes, and the scratch goes.
Host memory beyond the homes' budgets is the tensors of one module. A failed construction gives
every parameter back its meta tensor (:func:`tiermem.model.lifetime.undone_on_failure`), so a
retry with the right path works. Buffers on the meta device get their values the same way before
the model's buffers are placed.

Under data parallelism every rank starts from the same weights. A checkpoint holds the same bytes
on every rank (the same path must hold the same checkpoint on every node), so no rank sends its
values to another (:attr:`Values.agreed`) and each reads only what it keeps
(:func:`tiermem.train.layout.initial_pieces`): with its weights sharded over the ranks
(``shard_weights=True``, ZeRO-3; ZeroInfinity's weights off the device) its chunk of each bucket, a
row-major flat range being a byte range of the file (:meth:`WeightsFile.read_into` at an offset,
:meth:`WeightsFile.read_flat` where the stored dtype is cast): about 1/N of the checkpoint per rank,
no rank reading a bucket whole; with replicated weights (ZeRO-2) the whole bucket, which its working
weights need. Frozen parameters sharded over the ranks the same: their chunks alone, no broadcast
(those that keep a copy in their own dtype: its piece, in that dtype). Values from the modules'
initialization (a rank's random numbers may differ) or from a model given in memory (its ranks may
hold different values) are filled whole and broadcast from rank 0 bucket by bucket
(:meth:`~tiermem.train.homes.state_homes.StateHome.agree`): rank 0's win.

NOTE [Initialization on the meta device]
Without ``weights=``, a module's parameters are
initialized by its own ``reset_parameters()`` (for a transformers model, the model's
``_init_weights(module)``, as its ``post_init`` does), one module at a time, in the order the
model would initialize them in memory: for torch modules the order ``module.modules()`` lists them
(the order their constructors ran, which is where torch initializes), for transformers models the
order ``initialize_weights`` visits them (children first). Since the homes are built in another
order (buckets, in reverse order of use), each module's random-number state is recorded in a first
pass, which initializes into a scratch tensor and drops it; the values are made again from that
state when the module's bucket is built. The numbers are then those of the model initialized in
memory with the same seed, where the model's initialization is its modules' own: a constructor
that draws random numbers outside ``reset_parameters`` (or a parent that re-initializes its
children after building them) gives other numbers, and a module with parameters but no
``reset_parameters`` is refused by name. A transformers model built in memory draws for every
torch module's constructor first and then again in ``post_init``: its values come from the same
rules and distributions, not the same numbers (tests/test_materialize.py checks both).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional

import torch

from tiermem.checkpoint.weights_file import WeightsFile, open_weights
from tiermem.errors import ConfigError
from tiermem.train.weights.offdevice import point

log = logging.getLogger(__name__)

__all__ = ["FromCheckpoint", "FromInit", "Given", "Values", "has_meta", "values_for"]


def has_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


class Values:
    """The first value of each parameter and buffer. ``param`` gives a CPU (or device) tensor of the
    parameter's shape, in any floating dtype, which the caller copies from and drops."""

    building: Optional[str] = "building the homes"  # what construction's progress lines say it does (None: none)
    #: the same values on every rank (a file's bytes): under data parallelism no rank needs rank 0's,
    #: and each reads only what it keeps (NOTE [Models on the meta device])
    agreed: bool = False

    def param(self, name: str, p: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def expect(self, pieces: list[tuple[str, torch.Tensor, int, int]]) -> None:
        """The parameters :meth:`param_into` will be asked for, in that order, each with the
        elements ``[lo, hi)`` of it to be read (a source may read ahead)."""

    def param_into(self, name: str, p: torch.Tensor, out: torch.Tensor, at: int = 0) -> None:
        """Elements ``[at, at + out.numel())`` of the parameter's first value flattened (all of it
        by default), written into ``out`` (flat, any floating dtype)."""
        out.copy_(self.param(name, p).reshape(-1)[at : at + out.numel()])

    def fill_buffers(self, module: torch.nn.Module) -> None:
        """Give every buffer that has no values (on the meta device) its values, in place."""

    def close(self) -> None:
        """Construction is over: let go of files and scratch."""


class Given(Values):
    """The module's own tensors (a module that has its values)."""

    building = None  # nothing to report: copies of tensors already in memory

    def param(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return p.detach()


def _names(module: torch.nn.Module) -> dict[int, list[str]]:
    """id of each parameter -> every name it has in the module (tied weights have several)."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _buffer_slots(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for bname, buf in mod._buffers.items():
            if buf is not None:
                yield (f"{mod_name}.{bname}" if mod_name else bname), mod, bname, buf


# -- initialization, one module at a time ----------------------------------------------------------
def _init_order(
    module: torch.nn.Module, only: Optional[set[int]] = None
) -> list[tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]]:
    """Each module with tensors on the meta device and what initializes it, in the order the model
    would initialize them in memory (NOTE [Initialization on the meta device]); ``only``: the ids of
    the modules to take (default: all)."""
    hf_init = getattr(module, "_init_weights", None)
    if hf_init is not None and hasattr(module, "config"):  # a transformers model: its post_init's order and rule
        order: list[torch.nn.Module] = []

        def visit(m: torch.nn.Module) -> None:
            for child in m.children():
                visit(child)
            order.append(m)

        visit(module)
        return [(m, hf_init) for m in order if _meta_tensors(m) and (only is None or id(m) in only)]
    out = []
    for m in module.modules():
        if not _meta_tensors(m) or (only is not None and id(m) not in only):
            continue
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            if not [n for n, t in m.named_parameters(recurse=False) if t.is_meta]:
                continue  # buffers alone: the checks of fill_buffers name them
            raise ConfigError(
                f"tiermem: {type(m).__name__} has parameters on the meta device and no reset_parameters() to "
                f"initialize them; pass weights=PATH (a checkpoint), define reset_parameters(), or build this module "
                f"off the meta device"
            )
        out.append((m, lambda mod: mod.reset_parameters()))
    return out


def _meta_tensors(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    own = [*m.named_parameters(recurse=False), *((n, b) for n, b in m._buffers.items() if b is not None)]
    return [(n, t) for n, t in own if t.is_meta]


class FromInit(Values):
    """Each meta module initialized by its own rule, one at a time, with the random-number state it
    would have met in memory (NOTE [Initialization on the meta device])."""

    building = "initializing the model at its homes"

    def __init__(self, module: torch.nn.Module, *, only: Optional[set[int]] = None):
        """``only``: the ids of the modules to initialize (default: every module on the meta device)."""
        self._owner: dict[int, int] = {}  # id of a meta tensor -> index of the module initializing it
        self._plan = _init_order(module, only)
        self._states: list[torch.Tensor] = []
        self._cache: dict[int, dict[int, torch.Tensor]] = {}  # module index -> id of tensor -> value, until taken
        for i, (m, _) in enumerate(self._plan):
            for _, t in _meta_tensors(m):
                self._owner.setdefault(id(t), i)
        with torch.no_grad():
            for i in range(len(self._plan)):  # the first pass: each module's random-number state
                self._states.append(torch.get_rng_state())
                self._run(i)  # advances the generator as the model's own init would; values dropped
        self._after = torch.get_rng_state()

    def _run(self, i: int) -> dict[int, torch.Tensor]:
        """Initialize module ``i`` into scratch tensors; returns id of each meta tensor -> its value."""
        return self._drop(*self._plan[i])

    @staticmethod
    def _drop(m: torch.nn.Module, init: Callable[[torch.nn.Module], None]) -> dict[int, torch.Tensor]:
        """Run ``init`` on ``m`` with its meta tensors in scratch memory, which it returns by id;
        the module's tensors are on the meta device again afterwards, and those that had values
        (a module partly on the meta device) keep the values they had."""
        metas = _meta_tensors(m)
        own = [*m.parameters(recurse=False), *(b for b in m._buffers.values() if b is not None)]
        kept = [(t, t.detach().clone()) for t in own if not t.is_meta]
        scratch = {id(t): torch.empty(t.shape, dtype=t.dtype) for _, t in metas}
        for _, t in metas:
            point(t, scratch[id(t)])  # the module's tensor objects hold real memory while init runs
        try:
            init(m)
        finally:
            with torch.no_grad():
                for t, value in kept:
                    t.copy_(value)
            for _, t in metas:
                value = t.data
                point(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))
                scratch[id(t)] = value
        return scratch

    def _value(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        i = self._owner.get(id(t))
        if i is None:
            return None
        if i not in self._cache:
            state = torch.get_rng_state()
            torch.set_rng_state(self._states[i])
            try:
                with torch.no_grad():
                    self._cache[i] = self._run(i)
            finally:
                torch.set_rng_state(state)
        values = self._cache[i]
        value = values.pop(id(t))
        if not values:
            del self._cache[i]  # every tensor of the module taken: its scratch goes
        return value

    def param(self, name: str, p: torch.Tensor) -> torch.Tensor:
        if not p.is_meta:
            return p.detach()
        value = self._value(p)
        if value is None:
            raise ConfigError(
                f"tiermem: nothing initializes the parameter {name!r} on the meta device; pass weights=PATH"
            )
        return value

    def fill_buffers(self, module: torch.nn.Module) -> None:
        missing = []
        for name, owner, bname, buf in _buffer_slots(module):
            if buf.is_meta:
                value = self._value(buf)
                if value is None:
                    missing.append(name)
                else:
                    owner._buffers[bname] = value
        if missing:
            raise ConfigError(
                f"tiermem: the buffers {missing[:5]} are on the meta device and their modules' initialization does not "
                f"set them; build the model with buffers off the meta device (accelerate's init_empty_weights() "
                f"does), or pass weights=PATH holding them"
            )

    def close(self) -> None:
        self._cache.clear()
        torch.set_rng_state(self._after)  # the generator as after initializing the model in memory


# -- a checkpoint, one tensor at a time ------------------------------------------------------------
def _castable(stored: torch.dtype, wanted: torch.dtype) -> bool:
    if stored == wanted:
        return True
    return stored.is_floating_point and wanted.is_floating_point


class FromCheckpoint(Values):
    """Every parameter from ``weights`` by name (a tied weight by any of its names), checked whole
    against the model before anything is read; buffers from it where it holds them, else (on the
    meta device) from the modules' initialization."""

    agreed = True  # every rank reads the same file (the same path holds the same checkpoint on each node)

    def __init__(self, module: torch.nn.Module, weights: WeightsFile):
        self.weights = weights
        self.building = f"reading {weights.path}"
        self._key: dict[int, str] = {}
        names = _names(module)
        params = {id(p): p for p in module.parameters()}
        problems: list[str] = []
        for pid, aliases in names.items():
            found = [a for a in aliases if a in weights.entries]
            if not found:
                problems.append(f"missing {aliases[0]!r}")
                continue
            self._key[pid] = found[0]
            problems += _mismatch(found[0], weights, params[pid])
        buffers = {name: buf for name, _, _, buf in _buffer_slots(module)}
        for name, buf in buffers.items():
            if name in weights.entries:
                problems += _mismatch(name, weights, buf)
        known = {a for aliases in names.values() for a in aliases} | set(buffers)
        unexpected = sorted(set(weights.entries) - known)
        problems += [f"unexpected {n!r}" for n in unexpected[:10]]
        if problems:
            more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
            raise ConfigError(
                f"tiermem: weights={weights.path!r} does not match the model: {'; '.join(problems[:10])}{more}; "
                f"pass the checkpoint of this model (names as module.state_dict() gives them)"
            )
        # meta buffers the checkpoint lacks (rotary inv_freq): their modules' initialization, those modules only
        owners = {id(mod) for name, mod, _, buf in _buffer_slots(module) if buf.is_meta and name not in weights.entries}
        self._buffers_from_init = FromInit(module, only=owners) if owners else None

    def param(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return self.weights.read(self._key[id(p)])

    def expect(self, pieces: list[tuple[str, torch.Tensor, int, int]]) -> None:
        keys = [(self._key[id(p)], p, lo, hi) for _, p, lo, hi in pieces if id(p) in self._key]
        spans = {key: (lo, hi) for key, p, lo, hi in keys if (lo, hi) != (0, p.numel())}
        self.weights.expect([key for key, *_ in keys], spans=spans)

    def param_into(self, name: str, p: torch.Tensor, out: torch.Tensor, at: int = 0) -> None:
        key = self._key[id(p)]
        if not self.weights.read_into(key, out, at=at):  # stored in out's dtype: read in place
            out.copy_(self.weights.read_flat(key, at, at + out.numel()))  # cast: the span's elements alone

    def fill_buffers(self, module: torch.nn.Module) -> None:
        for name, owner, bname, buf in _buffer_slots(module):
            if name in self.weights.entries:
                value = self.weights.read(name).to(buf.dtype)
                if buf.is_meta:
                    owner._buffers[bname] = value
                else:
                    buf.copy_(value)
        if self._buffers_from_init is not None:
            self._buffers_from_init.fill_buffers(module)

    def close(self) -> None:
        self.weights.close()
        if self._buffers_from_init is not None:
            self._buffers_from_init.close()


def _mismatch(name: str, weights: WeightsFile, t: torch.Tensor) -> list[str]:
    e = weights.entries[name]
    if e.shape != tuple(t.shape):
        return [f"{name!r} is {e.shape} there, {tuple(t.shape)} in the model"]
    if not _castable(e.dtype, t.dtype):
        return [f"{name!r} is {e.dtype} there, which does not cast to the model's {t.dtype}"]
    return []


def values_for(module: torch.nn.Module, weights: Optional[str]) -> Values:
    """Where ``module``'s first values come from: ``weights`` when given, else its own tensors, or
    its initialization for those on the meta device."""
    if weights is not None:
        return FromCheckpoint(module, open_weights(weights))
    return FromInit(module) if has_meta(module) else Given()
