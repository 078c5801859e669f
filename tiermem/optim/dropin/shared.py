"""What tiermem's drop-in ``torch.optim`` optimizers share (CPUAdam, CPUSGD, CPUAdagrad, CPULion,
CPUAdafactor, CPUAdam8bit): parameter checks, the closure, the all-or-nothing finite check, state
created on a parameter's first step, the step count, and the stochastic rounding of bf16 weights.

A subclass declares only what is its own: its hyperparameters, once, as a table (``HYPERS``: name,
default, rule, the field of the step's record it fills; tiermem/optim/dropin/hyper_table.py) from
which the base makes the constructor (torch's signature), the groups' defaults, their checks and each
step's record (``RECORD``); a parameter's new state, the kernel and state tensors of its update
(:class:`Plan`), and (where it is not ``_run.run``) the functional entry that runs where the native
kernel cannot. The base runs the step loop (NOTE [Drop-in speed] in cpu_adam.py): the step
counts in one call, the hyperparameters made and checked once per group and step, the native library
found once per step, and each parameter's kernel called straight through ctypes. Every update of a step runs after
every gradient was checked: a step whose gradients hold an inf or NaN changes nothing (no weight,
state or step count) and sets ``last_step_skipped``. With ``bf16_stochastic_round=True`` the
parameters may be bf16 (no fp32 copy is kept; NOTE [Stochastic rounding bits] in
tiermem/optim/kernels/sr.py); their rounding is keyed by ``sr_seed`` (default: ``torch.initial_seed()``
when the optimizer is built, so ``torch.manual_seed`` makes runs repeat) and by each parameter's
index in the optimizer (the numbering of ``state_dict()``), and both are kept in the param groups, so
a resumed run rounds as the uninterrupted one.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch
from torch.optim import Optimizer

from tiermem.config.rules import is_int
from tiermem.errors import ConfigError
from tiermem.optim.arg_checks import make_hyper
from tiermem.optim.dropin import hyper_table as table
from tiermem.optim.dropin.hyper_table import Hyper, Params
from tiermem.optim.kernels import dispatch as _run, native as _native
from tiermem.optim.kernels.sr import StochasticRound

log = logging.getLogger(__name__)


class Plan(NamedTuple):
    """One parameter's update in a step, as its drop-in declares it."""

    kernel: Optional[_run.Kernel]  # the native single pass; None: the functional path only (Adafactor)
    state: tuple[Optional[torch.Tensor], ...]  # the state tensors, in the kernel's order
    variant: tuple = ()  # what else the step's hyperparameters depend on (SGD: a buffer new this step)


# NOTE [Drop-in contract]
# A drop-in follows torch.optim.Optimizer's contract (the installed torch/optim/optimizer.py is the
# oracle) or refuses by name: torch reads every param group (tensors, generators, named_parameters()
# pairs, the checks on duplicates and names), builds and loads state dicts, runs the hooks; the drop-in
# checks what torch would keep before it keeps it. A group, given or loaded, that sets a flag of a torch
# optimizer the drop-in does not implement (TORCH_FLAGS, to anything but its "off" value) is refused
# naming it, never ignored; ``foreach`` and ``fused`` choose torch's implementation, not the update, so
# they are accepted (the drop-in is its own implementation). A loaded group's missing hyperparameters
# take the defaults and a plain-number ``step`` becomes a tensor, as torch's ``__setstate__`` does. A
# step checks everything it could refuse (groups, parameters, state dtypes and sizes: the native
# kernels read raw memory) before it changes anything. Pickling keeps the drop-in's own settings.
TORCH_FLAGS = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False, "nesterov": False}


def _step_tensor(name: str, step: Any) -> torch.Tensor:
    """A loaded ``step`` as the drop-ins keep it: a 0-dim fp32 tensor (older torch saved a number)."""
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        return (
            step
            if step.dtype == torch.float32 and step.dim() == 0
            else torch.tensor(float(step.item()), dtype=torch.float32)
        )
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return torch.tensor(float(step), dtype=torch.float32)
    raise ConfigError(f"tiermem: {name} got step={step!r} in a state dict; it must be a number or a one-element tensor")


class CPUOptimizer(Optimizer):
    """The base of tiermem's drop-in CPU optimizers (module docstring, NOTE [Drop-in contract]). A
    drop-in's Args list its hyperparameters; what every drop-in takes after them is documented once,
    here (``SHARED_ARGS``), and is the docstring of each made constructor."""

    SHARED_ARGS: ClassVar[str] = """Build the optimizer from its hyperparameters (its class's Args, or below) and these.

    Args:
        params: the parameters to optimize, or param groups (dicts), as ``torch.optim`` takes them;
            CPU tensors.
        check_finite: check every gradient for inf/NaN before any update; a step that finds one
            changes nothing and sets ``last_step_skipped``. False skips the check.
        bf16_stochastic_round: take bf16 parameters and keep no fp32 copy, rounding each update
            stochastically (NOTE [Stochastic rounding bits]).
        sr_seed: the seed of that rounding (default: ``torch.initial_seed()`` when built).
    """

    _sparse_hint = "use a torch.optim optimizer that takes sparse gradients (torch.optim.SGD, Adagrad)"
    _settings: tuple[str, ...] = ("check_finite", "last_step_skipped")  # kept by pickle and deepcopy
    _state_keys: tuple[str, ...] = ()  # the fp32 state tensors, of the parameter's size, its kernels read
    #: the hyperparameters, each once (tiermem/optim/dropin/hyper_table.py): the constructor is made from it
    HYPERS: ClassVar[tuple[Hyper, ...]] = ()
    #: the checked record of one step's hyperparameters (SGDHyper, AdamHyper, ...), filled from HYPERS
    RECORD: ClassVar[Callable[..., Any]]
    _group_table: ClassVar[tuple[Hyper, ...]] = ()  # HYPERS' param group entries
    _setting_table: ClassVar[tuple[Hyper, ...]] = ()  # HYPERS' settings of the optimizer itself

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A drop-in that declares ``HYPERS`` gets its constructor made from them (torch's signature)."""
        super().__init_subclass__(**kwargs)
        if "HYPERS" not in cls.__dict__:
            return
        cls._group_table = tuple(h for h in cls.HYPERS if not h.setting)
        cls._setting_table = tuple(h for h in cls.HYPERS if h.setting)
        cls._settings = (*CPUOptimizer._settings, *(h.name for h in cls._setting_table))
        sig = table.signature(cls.HYPERS)

        def __init__(self: CPUOptimizer, *args: Any, **kwargs: Any) -> None:
            given = sig.bind(self, *args, **kwargs)
            given.apply_defaults()
            self._construct(given.arguments)

        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__module__ = cls.__module__  # where the class is: what docs and tracebacks name
        __init__.__doc__ = cls.SHARED_ARGS
        __init__.__signature__ = sig  # type: ignore[attr-defined]  # what inspect, help() and checked_arguments read
        cls.__init__ = __init__  # type: ignore[method-assign]  # made from the table, as a dataclass's

    def _construct(self, given: dict[str, Any]) -> None:
        """The made constructor's body: the settings and the defaults checked, then torch's."""
        where = f"{type(self).__name__} "
        settings = {h.name: given[h.name] for h in self._setting_table}
        table.check(where, self._setting_table, settings)
        self.__dict__.update(settings)
        defaults = {h.name: given[h.name] for h in self._group_table}
        table.check(where, self._group_table, defaults)
        CPUOptimizer.__init__(
            self,
            given["params"],
            defaults,
            check_finite=given["check_finite"],
            bf16_stochastic_round=given["bf16_stochastic_round"],
            sr_seed=given["sr_seed"],
        )

    def __init__(
        self,
        params: Params,
        defaults: dict[str, Any],
        *,
        check_finite: bool,
        bf16_stochastic_round: bool,
        sr_seed: Optional[int],
    ) -> None:
        name = type(self).__name__
        for key, value in (("check_finite", check_finite), ("bf16_stochastic_round", bf16_stochastic_round)):
            if not isinstance(value, bool):
                raise ConfigError(f"tiermem: {name} {key}={value!r} is invalid: it must be True or False")
        if sr_seed is not None and not is_int(sr_seed):
            raise ConfigError(f"tiermem: {name} sr_seed={sr_seed!r} is invalid: it must be an int or None")
        self.check_finite = check_finite
        self.last_step_skipped = False
        self._index: Optional[dict[int, int]] = None
        defaults = {
            **defaults,
            "bf16_stochastic_round": bf16_stochastic_round,
            "sr_seed": torch.initial_seed() if sr_seed is None else sr_seed,
        }
        super().__init__(params, defaults)

    # -- what a subclass supplies ------------------------------------------------------------------
    def _check_group(self, group: dict[str, Any]) -> None:
        """A param group's hyperparameters, each by its rule (HYPERS)."""
        table.check(f"{type(self).__name__} ", self._group_table, group)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _plan(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> Plan:
        raise NotImplementedError

    # NOTE [Checked once a step]
    # A drop-in's step checks each stepped group's hyperparameters once, by the rules HYPERS names
    # (_check_step, before anything changes), and then makes the typed record its kernels read
    # (SGDHyper, AdamHyper, ...) from the same values with ``prechecked=True``: the record converts
    # them (Python floats, the kernel's scalars) but does not check them a second time. The functional
    # entries (adam_step, sgd_step, ...) take their arguments from a caller tiermem has not checked,
    # so their records check, by the same rules (config/rules.py), on every call. TieredModel's step
    # makes its records once too: when the step's update is snapshotted, each run's group dict becomes
    # the record of its bucket's kernel (tiermem.optim.formats.hyper_record, the kind's row in
    # optim/families.py), checked once per group, kernel and step count, before any bucket changes
    # (train/step/updates.py checked_records); the kernels of the step take the record
    # (formats.update), not the dict, through the entries' private paths (adam_update, ...).
    def _hyper(self, group: dict[str, Any], step: int, variant: tuple) -> Any:
        """The record of a step's hyperparameters (``RECORD``, from HYPERS and ``variant``), the group
        checked already this step (NOTE [Checked once a step])."""
        values = table.record(self._group_table, group)
        return make_hyper(self.RECORD, step=step, prechecked=True, **values, **self._variant(variant))

    def _variant(self, variant: tuple) -> dict[str, Any]:
        """The record's fields a plan's variant sets (SGD: a momentum buffer new this step)."""
        return {}

    def _functional(
        self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, hyper: Any, sr: Optional[StochasticRound]
    ) -> None:
        """The checked functional path, where the native kernel cannot run (no build, strides)."""
        assert plan.kernel is not None  # a plan without a kernel supplies its own functional path
        _run.run(plan.kernel, p, plan.state, grad, None, hyper, stochastic_round=sr, check_finite=False, impl=None)

    # -- torch.optim.Optimizer -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group`` (which reads its ``params``:
        tensors, a generator, or ``named_parameters()`` pairs); its hyperparameters and parameters are
        checked before it is kept, and refused whole.

        Args:
            param_group: the group: ``"params"`` and the hyperparameters it sets.
        """
        super().add_param_group(param_group)  # torch's reading of the group: the oracle
        group = self.param_groups[-1]
        try:
            self._check_loaded_group(group, f"param group {len(self.param_groups) - 1}")
            for p in group["params"]:
                self._check_param(p, group["bf16_stochastic_round"])
        except BaseException:
            self.param_groups.pop()  # refused whole: the optimizer is as it was
            raise
        self._index = None

    def _check_loaded_group(self, group: dict[str, Any], where: str) -> None:
        """A group's hyperparameters (given, or loaded from a state dict): the drop-in's rules, and no
        flag of a torch optimizer that this one does not implement (NOTE [Drop-in contract])."""
        name = type(self).__name__
        for key, off in TORCH_FLAGS.items():
            if key not in self.defaults and key in group and group[key] not in (off, None):
                raise ConfigError(
                    f"tiermem: {name} got {key}={group[key]!r} in {where}, which {name} does not "
                    f"implement; use the torch.optim optimizer for it, or set {key}={off!r}"
                )
        self._check_group(group)
        if not isinstance(group["bf16_stochastic_round"], bool):
            raise ConfigError(
                f"tiermem: {name} bf16_stochastic_round={group['bf16_stochastic_round']!r} is invalid: "
                f"it must be True or False"
            )

    def _fill_group(self, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        """A loaded group's missing hyperparameters (an older torch's state dict, a torch optimizer's),
        as torch's optimizers' ``__setstate__`` fill theirs: the defaults."""
        for key, value in defaults.items():
            group.setdefault(key, value)

    def _check_param(self, p: torch.Tensor, stochastic: bool) -> None:
        ok = p.is_cpu and (p.dtype == torch.float32 or (stochastic and p.dtype == torch.bfloat16))
        if not ok:
            raise ConfigError(
                f"tiermem: {type(self).__name__} got a {p.dtype} parameter on {p.device} of shape "
                f"{tuple(p.shape)}; it updates fp32 CPU parameters only (bf16 ones with "
                f"bf16_stochastic_round=True); use a torch.optim optimizer for others, or "
                f"TieredModel for mixed precision"
            )

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, state, param_groups) and the drop-in's own settings (pickle, deepcopy)."""
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in self._settings if k in self.__dict__}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling, and the end of ``load_state_dict``: the groups filled and checked, a plain-number
        ``step`` made a tensor (as torch's optimizers' ``__setstate__``), before anything is kept."""
        defaults = state.get("defaults", self.__dict__.get("defaults"))
        assert defaults is not None  # an unpickled optimizer brings its defaults; a loading one has them
        self.__dict__.setdefault("defaults", defaults)  # (unpickling: the checks below read them)
        for i, group in enumerate(state.get("param_groups", ())):
            self._fill_group(group, defaults)
            self._check_loaded_group(group, f"param group {i} of the state dict")
        steps = {}
        for key, pstate in state.get("state", {}).items():
            if isinstance(pstate, dict) and "step" in pstate:
                steps[key] = _step_tensor(type(self).__name__, pstate["step"])
        for key, step in steps.items():
            state["state"][key]["step"] = step
        super().__setstate__(state)
        self.__dict__.setdefault("check_finite", True)
        self.__dict__.setdefault("last_step_skipped", False)
        self._index = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, or of the torch optimizer it stands in for. Groups that
        set a flag this optimizer does not implement (``maximize``, ``amsgrad``, ...) are refused by
        name before anything changes; missing hyperparameters take the defaults, a plain-number
        ``step`` becomes a tensor.

        Args:
            state_dict: what ``state_dict()`` returned.
        """
        super().load_state_dict(state_dict)  # torch's rules (names included); checks in __setstate__
        # torch casts floating-point state to the parameter's dtype: a bf16 parameter's fp32 moments
        # would lose their precision and 8-bit codes their type. The drop-ins keep fp32 floating-point
        # state for every parameter (the kernels read nothing else), and codes as they were saved.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    dtype = torch.float32 if value.is_floating_point() else value.dtype
                    self.state[p][key] = value.detach().to(p.device, dtype=dtype, copy=True)
        self._index = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]  # torch's stub: overloads
        """One update of every parameter with a gradient, after every gradient was checked: a step
        whose gradients hold an inf or NaN changes nothing and sets ``last_step_skipped``.

        Args:
            closure: reevaluates the model and returns the loss, as ``torch.optim`` takes it.

        Returns:
            The closure's loss, or None without one.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        self._check_step(todo)  # a step is all or nothing: what it could refuse, refused before any change
        self._index = None  # the parameters' numbering, as the groups hold them now (a parameter swapped in)
        # A step is atomic: every gradient is checked before any parameter is written.
        self.last_step_skipped = self.check_finite and any(
            _run.any_nonfinite(p.grad) for _, params in todo for p in params
        )
        if self.last_step_skipped:
            log.info("tiermem: %s skipped a step: a gradient holds inf or NaN", type(self).__name__)
            return loss
        for group, params in todo:
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One update of each of ``params`` (they have gradients, checked). Every call is made before the
        first runs (NOTE [Drop-in speed] in cpu_adam.py); the hyperparameters are made and checked once
        per step and variant, the native library looked up once per kernel."""
        made: dict[tuple, tuple[Any, Optional[ctypes.Array]]] = {}
        libs: dict[str, Optional[ctypes.CDLL]] = {}
        calls: list[_run.NativeCall] = []
        for p, step in zip(params, self._count(group, params)):
            plan = self._plan(p, self.state[p], group)
            kernel, grad = plan.kernel, p.grad
            assert grad is not None  # the drop-ins step the parameters that have a gradient
            key = (None if kernel is None else kernel.name, step, plan.variant)
            if key not in made:
                hyper = self._hyper(group, step, plan.variant)
                made[key] = (hyper, None if kernel is None else _native.floats(kernel.scalars(hyper)))
            hyper, scalars = made[key]
            sr = self._rounding(p, group) if p.dtype == torch.bfloat16 else None
            call = None
            if kernel is not None and scalars is not None:
                if kernel.library not in libs:
                    libs[kernel.library] = _run.native_library(kernel)
                lib = libs[kernel.library]
                keys = None if sr is None else sr.keys(step)
                call = None if lib is None else _run.native_call(kernel, lib, p, plan.state, grad, scalars, keys)
            calls.append(call or (self._functional, (plan, p, grad, hyper, sr)))
        for fn, args in calls:
            fn(*args)

    def _check_step(self, todo: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> None:
        """Everything a step could refuse, before it changes anything: each stepped group's
        hyperparameters, parameters (one may have been swapped into a group since it was added) and
        their state (loaded, or edited: the kernels read it as their dtypes and sizes, so it must be)."""
        for group, params in todo:
            if not params:
                continue
            self._check_group(group)
            for p in params:
                grad = p.grad
                assert grad is not None  # todo holds the parameters with a gradient
                if grad.is_sparse:
                    raise ConfigError(
                        f"tiermem: {type(self).__name__} got a sparse gradient for a parameter of shape "
                        f"{tuple(p.shape)}; {self._sparse_hint}"
                    )
                self._check_param(p, group["bf16_stochastic_round"])
                self._check_state(p, self.state.get(p, {}))  # (no entry made for a new parameter)

    def _check_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """A parameter's state as its kernels read it: each tensor they read of its dtype and size, on
        the CPU, and the step count a one-element tensor."""
        name = type(self).__name__
        for key, value in state.items():
            if key == "step":
                if not (isinstance(value, torch.Tensor) and value.numel() == 1):
                    raise ConfigError(
                        f"tiermem: {name} state 'step' of a parameter of shape {tuple(p.shape)} is "
                        f"{value!r}; it must be a one-element tensor, as torch keeps it"
                    )
                continue
            spec = self._state_spec(p, key, state)
            if spec is None or value is None:  # not read; torch.optim.SGD keeps a None buffer
                continue
            dtype, numel = spec
            if not (
                isinstance(value, torch.Tensor) and value.dtype == dtype and value.numel() == numel and value.is_cpu
            ):
                what = (
                    f"a {value.dtype} tensor of {value.numel()} elements on {value.device}"
                    if isinstance(value, torch.Tensor)
                    else f"a {type(value).__name__}"
                )
                raise ConfigError(
                    f"tiermem: {name} state {key!r} of a parameter of shape {tuple(p.shape)} is {what}; "
                    f"its kernel reads a {dtype} CPU tensor of {numel} elements; load a state dict "
                    f"saved for these parameters, or clear the state"
                )

    def _state_spec(self, p: torch.Tensor, key: str, state: dict[str, Any]) -> Optional[tuple[torch.dtype, int]]:
        """The dtype and element count the kernels read ``state[key]`` as; None: they do not read it."""
        return (torch.float32, p.numel()) if key in self._state_keys else None

    def _count(self, group: dict[str, Any], params: list[torch.Tensor]) -> list[int]:
        """Each parameter's step count after this step's increment, its state made on its first step."""
        steps = []
        for p in params:
            state = self.state[p]
            if not state:
                self._init_state(p, state, group)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            elif "step" not in state:  # torch.optim.SGD's state keeps no count: its buffer exists, so not step 1
                state["step"] = torch.tensor(1.0, dtype=torch.float32)
            steps.append(state["step"])
        torch._foreach_add_(steps, 1)  # one call for the group, as torch's optimizers count
        return [int(s) for s in torch.stack(steps).tolist()]

    def _rounding(self, p: torch.Tensor, group: dict[str, Any]) -> StochasticRound:
        if self._index is None:
            params = (q for g in self.param_groups for q in g["params"])
            self._index = {id(q): i for i, q in enumerate(params)}
        return StochasticRound.for_parameter(int(group["sr_seed"]), f"param{self._index[id(p)]}")
