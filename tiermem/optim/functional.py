"""``adam_step``: one fused Adam/AdamW update of fp32 master weights and moments, and the choice of
implementation behind it.

NOTE [found_inf: nothing changes]
A step with an inf/NaN gradient must change nothing, yet the single pass commits each element as it
goes: an inf near the end would be found after the rest was written. Undo copies of what was
written would cost 24 bytes per parameter written and read back; instead the gradient alone is read
once ahead of the update, by a compiled ``isfinite().all()`` reduction (no temporary; 2 bytes per
parameter for bf16 against the update's 28, but one stream reads slower than the update's seven:
bench/cpu_adam.py measures it at 14-16% of the bf16 step). Callers that already know the gradients
are finite (TieredModel learns it from the global gradient norm it computes anyway) pass
``check_finite=False`` and pay nothing.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch

from tiermem.config.argdocs import shares_args
from tiermem.config.specs import is_number
from tiermem.errors import ConfigError, TierMemError
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.kernels import compiled as _compiled, dispatch as _run, eager as _kernels, native as _native
from tiermem.optim.kernels.eager import AdamTensors

if TYPE_CHECKING:
    from tiermem.optim.kernels.sr import StochasticRound

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("native", "compiled", "fallback", "reference")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_COMPILED = _compiled.CompiledAdam()
_said = threading.Lock()
_said_which: set[str] = set()
H = TypeVar("H")

#: the arguments every functional entry (adam_step, sgd_step, ..., adafactor_step) takes alike,
#: documented once: joined to each entry's own Args (config/argdocs.py)
ENTRY_ARGS = """
    master: fp32 master weights (or bf16 ones with ``stochastic_round``), updated in place.
    grad: the gradient, fp32, bf16 or fp16, of master's shape.
    step: 1-based count of this tensor's updates including this one.
    grad_scale: the loss scale the gradient carries; it is divided out first.
    clip_coef: the clip coefficient the (unscaled) gradient is multiplied by.
    out: receives the master's new value in its own dtype (fp32, bf16 or fp16), when given.
    stochastic_round: with bf16 ``master``, the :class:`StochasticRound` of this parameter.
    check_finite: False skips the read of ``grad`` for inf/NaN when the caller knows it is finite.

Returns:
    ``found_inf``: True when ``grad`` holds an inf or NaN, in which case nothing was written.
"""


@shares_args(ENTRY_ARGS)
def adam_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: Optional[torch.Tensor] = None,
    check_finite: bool = True,
    impl: Optional[str] = None,
    stochastic_round: Optional["StochasticRound"] = None,
) -> bool:
    """One Adam (``adamw=False``) or AdamW update, in place, in one pass over the optimizer state
    (plus one read of ``grad`` for the finite check, see NOTE [found_inf: nothing changes]).

    ``master``, ``exp_avg`` and ``exp_avg_sq`` are fp32 CPU tensors of one shape (typically 1-D
    views into a flat bucket); ``grad`` has that shape and is fp32, bf16 or fp16; the gradient used
    is ``grad / grad_scale * clip_coef``, unscaled as torch.amp.GradScaler does (a multiplication by
    the fp32 reciprocal: exact for the powers of two that loss scaling uses) and then clipped as
    ``clip_grad_norm_`` does (a multiplication). ``step`` counts updates including this one (torch's
    ``state["step"]`` after its increment). When ``out`` (fp32/bf16/fp16) is given, it receives
    ``master.to(out.dtype)`` after the update. The math is torch.optim.Adam/AdamW's for-loop
    (``foreach=False``) op for op, except that the square root is correctly rounded.

    Returns ``found_inf``: True when some gradient element is inf or NaN, in which case nothing was
    written. ``check_finite=False`` skips that check (the caller knows the gradients are finite)
    and always returns False. ``impl`` picks an implementation ("native", "compiled", "fallback",
    "reference") instead of the default, for tests and benchmarks.

    bf16 master weights (no fp32 copy) take ``stochastic_round=StochasticRound(...)``: the update is
    computed in fp32, as above, and rounded stochastically into ``master`` (NOTE [Stochastic rounding
    bits] in tiermem/optim/kernels/sr.py); that path runs the native kernel ("native" and "compiled" pick it,
    "fallback" and "reference" the torch-ops reference).

    Args:
        exp_avg: fp32 first moment, updated in place.
        exp_avg_sq: fp32 second moment, updated in place.
        lr: learning rate.
        beta1: coefficient of the running average of the gradient.
        beta2: coefficient of the running average of its square.
        eps: term added to the denominator.
        weight_decay: decoupled (``adamw=True``) or L2 (``adamw=False``) weight decay.
        adamw: AdamW (decoupled weight decay) when True, Adam when False.
        impl: ``"native"``, ``"compiled"``, ``"fallback"`` or ``"reference"`` instead of the default.
    """
    hyper = make_hyper(
        AdamHyper,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw=adamw,
        grad_scale=grad_scale,
        clip_coef=clip_coef,
    )
    return adam_update(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out,
        hyper,
        stochastic_round=stochastic_round,
        check_finite=check_finite,
        impl=impl,
    )


def adam_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
    hyper: AdamHyper,
    *,
    stochastic_round: Optional["StochasticRound"],
    check_finite: bool,
    impl: Optional[str],
) -> bool:
    """:func:`adam_step` once its hyperparameters are checked (``hyper``): what the drop-ins call with
    the hyperparameters they made once for the step."""
    _check_impl(impl)
    if stochastic_round is not None or (isinstance(master, torch.Tensor) and master.dtype == torch.bfloat16):
        return _run.run(
            _run.ADAM,
            master,
            (exp_avg, exp_avg_sq),
            grad,
            out,
            hyper,
            stochastic_round=stochastic_round,
            check_finite=check_finite,
            impl=None if impl is None else "native" if impl in ("native", "compiled") else "reference",
        )
    _check_tensors(master, exp_avg, exp_avg_sq, grad, out)
    if master.numel() == 0:
        return False
    # detached views: the same memory, without autograd's view of it (dynamo guards on requires_grad)
    detached = (
        master.detach(),
        exp_avg.detach(),
        exp_avg_sq.detach(),
        grad.detach(),
        out if out is None else out.detach(),
    )
    name, tensors = _choose(impl, detached)
    if name == "native":
        found_inf = _native_step(tensors, hyper, check_finite=check_finite, impl=impl)
        if found_inf is not None:
            return found_inf
        name = _default()  # it cannot be built here, and impl=None lets it fall back
    if name == "compiled":
        found_inf = _compiled_step(tensors, hyper, check_finite=check_finite, impl=impl)
        if found_inf is not None:
            return found_inf
        name = "fallback"  # it cannot be compiled here, and impl=None lets it fall back
    return _eager_step(name, tensors, hyper, check_finite=check_finite, impl=impl)


def _choose(impl: Optional[str], tensors: AdamTensors) -> tuple[str, AdamTensors]:
    """Which kernel runs, and the tensors (:data:`AdamTensors`, detached) to hand it: viewed as 1-D
    where the kernel needs flat tensors, as they are where it takes any strides."""
    master = tensors[0]
    if master.device.type != "cpu":  # optimizer state on an accelerator: torch's fused kernel there
        return "device", tensors
    if not all(t is None or t.is_contiguous() for t in tensors):
        return "reference", tensors  # elementwise ops work on any strides; only the reference takes them
    name = impl if impl is not None else _default()
    return name, tuple(None if t is None else t.view(-1) for t in tensors)  # type: ignore[return-value]  # the five, flat


def _native_step(tensors: AdamTensors, hyper: AdamHyper, *, check_finite: bool, impl: Optional[str]) -> Optional[bool]:
    """The native single pass (NOTE [Native default]): found_inf, or None when the library cannot be
    built here and ``impl`` (None) lets the caller fall back."""
    try:
        lib = _native.library(_run.ADAM.library)
    except _native.NativeUnavailable as e:
        if impl == "native":
            raise TierMemError(
                f"tiermem: the native CPU Adam is unavailable here ({e}); install a C++ compiler "
                f"(g++ 12 or newer), or pass impl=None"
            ) from e
        return None
    master, exp_avg, exp_avg_sq, grad, out = tensors
    if check_finite and _native.any_nonfinite(grad):
        return True
    s = _native.floats(_run.ADAM.scalars(hyper))
    fn, args = _run.ADAM.native(lib, master.numel(), master, (exp_avg, exp_avg_sq), grad, out, s, None)
    fn(*args)
    if impl is None:
        _say("native")
    return False


def _compiled_step(
    tensors: AdamTensors, hyper: AdamHyper, *, check_finite: bool, impl: Optional[str]
) -> Optional[bool]:
    """The compiled single pass: found_inf, or None when it cannot be compiled here and ``impl``
    (None) lets the caller fall back."""
    try:
        if check_finite and _COMPILED.any_nonfinite(tensors[3]):
            return True
        _COMPILED.adam(*tensors, hyper)
    except _compiled.CompileUnavailable as e:
        if impl == "compiled":
            raise TierMemError(
                f"tiermem: the compiled CPU Adam is unavailable here ({e}); install "
                f"a C++ compiler that torch.compile can use, or pass impl=None"
            ) from e
        return None
    if impl is None:
        _say("compiled")
    return False


def _eager_step(name: str, tensors: AdamTensors, hyper: AdamHyper, *, check_finite: bool, impl: Optional[str]) -> bool:
    """An uncompiled kernel: torch's fused one on an accelerator ("device"), torch's fused AdamW with
    conversions ("fallback"), or the for-loop oracle ("reference"). Returns found_inf."""
    if check_finite and _kernels._eager_any_nonfinite(tensors[3]):
        return True
    if name == "device":
        kernel = _kernels._device_adam
    elif name == "fallback":
        kernel = _kernels._fused_fallback_adam
    else:
        kernel = _kernels._single_tensor_adam
    kernel(tensors, hyper)
    if impl is None and name == "fallback":
        _say("fallback")
    return False


def any_nonfinite(grad: torch.Tensor) -> bool:
    """Whether ``grad`` holds an inf or NaN, read once, with the check ``adam_step`` uses."""
    grad = grad.detach()
    if grad.numel() == 0:
        return False
    default = _default() if grad.is_contiguous() and grad.dtype in GRAD_DTYPES else "fallback"
    if default == "native":
        return _native.any_nonfinite(grad.view(-1))
    if default == "compiled":
        try:
            return _COMPILED.any_nonfinite(grad.view(-1))
        except _compiled.CompileUnavailable:
            _say("fallback")
    return _kernels._eager_any_nonfinite(grad)


def implementation() -> str:
    """The implementation ``adam_step`` uses by default on CPU tensors here: "native" (the C++
    kernel, where it builds), else "compiled" (the torch.compile'd one), else "fallback" (torch's fused
    AdamW with conversions; forced by ``TIERMEM_NO_COMPILE``).

    Answers from what is known when a kernel has been built (or has failed to); otherwise builds
    (or loads from the cache) the native library, and where that fails compiles the most common
    kernel (bf16 grad in, bf16 weights out; seconds, or less when cached), to find out.
    """
    if _compiled.disabled_by_env():
        return "fallback"
    if _default() == "compiled" and not _COMPILED.seconds():
        warm_up()
    return _default()


def warm_up(
    grad_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    out_dtypes: tuple[Optional[torch.dtype], ...] = (torch.bfloat16,),
    *,
    adam_l2: bool = False,
) -> dict[str, float]:
    """Compile (or load from the cache) the kernels for these dtypes now, rather than on the first
    step; returns seconds per kernel. Does nothing when compiling is off or unavailable.

    Args:
        grad_dtypes: the gradient dtypes to build kernels for.
        out_dtypes: the dtypes of ``out`` to build kernels for (None: no ``out``).
        adam_l2: build the Adam (L2 weight decay) kernels instead of AdamW's.
    """
    if _compiled.disabled_by_env():
        return {}
    for g in grad_dtypes:
        _check_dtype("grad", g, GRAD_DTYPES)
    for o in out_dtypes:
        if o is not None:
            _check_dtype("out", o, OUT_DTYPES)
    if _default() == "native":  # one library serves every variant: nothing to compile
        return {}
    for g in grad_dtypes:
        for o in out_dtypes:
            try:
                _COMPILED.update_fn((g, o, adam_l2, False))
                _COMPILED.all_finite_fn(g)
            except _compiled.CompileUnavailable:
                _say("fallback")
                return {}
    return {str(k): v for k, v in _COMPILED.seconds().items()}


def compile_seconds() -> dict[str, float]:
    """Seconds each compiled kernel took to build (or load from the cache) in this process."""
    return {str(k): v for k, v in _COMPILED.seconds().items()}


# NOTE [Native default]
# fp32-master CPU Adam runs the native C++ kernel (tm_adam, tiermem/optim/kernels/csrc/elementwise.py)
# where its library builds: it gives the compiled kernel's bits (bench/native_adam_ab.py: 0 ulps on
# master, moments and out over grad/out dtypes, AdamW and L2, odd sizes; only the NaN written to a
# bf16 ``out`` from a non-finite gradient passed with check_finite=False is encoded otherwise), runs
# faster, and costs a process no dynamo import or trace (~10 CPU s a fresh process). The compiled
# kernel stays the fallback where the library cannot be built; TIERMEM_NO_COMPILE turns both off.
def _default() -> str:
    """The implementation CPU Adam runs by default here (NOTE [Native default])."""
    if _compiled.disabled_by_env():
        return "fallback"
    if _native.available(_run.ADAM.library):
        return "native"
    return "fallback" if _COMPILED.failure is not None else "compiled"


def _say(which: str) -> None:
    """Log once per process which implementation runs, and why the fallback does."""
    if which in _said_which:
        return
    with _said:
        if which in _said_which:
            return
        _said_which.add(which)
    if which == "native":
        log.info("tiermem: CPU Adam runs the native single-pass kernel")
    elif which == "compiled":
        log.info("tiermem: CPU Adam runs the torch.compile'd single-pass kernel")
    elif _compiled.disabled_by_env():
        log.info("tiermem: CPU Adam runs torch's fused AdamW (TIERMEM_NO_COMPILE is set)")
    else:
        log.warning(
            "tiermem: CPU Adam runs torch's fused AdamW with conversions, slower than the "
            "compiled kernel, because compiling failed: %s",
            _COMPILED.failure,
        )


def compile_disabled() -> bool:
    """Whether ``TIERMEM_NO_COMPILE`` forces the fallback kernel (set to anything but "" or "0")."""
    return _compiled.disabled_by_env()


def as_number(value: object) -> Any:
    """A one-element tensor (torch optimizers allow a tensor lr) as the number it holds (anything
    else as it is: the hyperparameters' rules check it)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def make_hyper(cls: Callable[..., H], *, step: object, **values: Any) -> H:
    """The hyperparameters of one update, as every functional entry takes them: ``step`` a whole
    number, a one-element tensor as the number it holds; ``cls`` (AdamHyper, SGDHyper, ...) checks them
    (one validation path for the entries and the drop-ins), and its ``where`` names the entry in errors."""
    return cls(step=_as_step(step, getattr(cls, "where", "adam_step ")), **{k: as_number(v) for k, v in values.items()})


def _as_step(step: object, where: str) -> int:
    value = as_number(step)
    if not is_number(value) or not math.isfinite(value) or value != int(value):
        raise ConfigError(
            f"tiermem: {where}step={step!r} is invalid: it must be a whole number "
            f"of updates including this one, >= 1; pass an int"
        )
    return int(value)


def _check_impl(impl: Optional[str]) -> None:
    if impl is not None and impl not in IMPLEMENTATIONS:
        raise ConfigError(
            f"tiermem: adam_step impl={impl!r} is unknown; pass one of {IMPLEMENTATIONS} or None for the default"
        )


def _check_dtype(name: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    if dtype not in allowed:
        raise ConfigError(
            f"tiermem: adam_step {name} has dtype {dtype}; it must be one of "
            f"{', '.join(str(d) for d in allowed)}; convert it first"
        )


def _check_tensors(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
) -> None:
    named = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "grad": grad}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tiermem: adam_step {name} is a {type(t).__name__}, not a tensor; pass a CPU tensor")
        if t.device != master.device or t.device.type == "meta":
            raise ConfigError(
                f"tiermem: adam_step {name} is on {t.device} but master is on {master.device}; "
                f"all tensors must be on one CPU or accelerator device; move them there"
            )
        if t.shape != master.shape:
            raise ConfigError(
                f"tiermem: adam_step {name} has shape {tuple(t.shape)} but master has "
                f"{tuple(master.shape)}; pass tensors of one shape"
            )
    for name in ("master", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise ConfigError(
                f"tiermem: adam_step {name} has dtype {named[name].dtype}; master weights "
                f"and moments must be torch.float32; keep them in fp32"
            )
    _check_dtype("grad", grad.dtype, GRAD_DTYPES)
    if out is not None:
        _check_dtype("out", out.dtype, OUT_DTYPES)
    ptrs = [master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr()]
    if master.numel() and len(set(ptrs)) != len(ptrs):
        raise ConfigError(
            "tiermem: adam_step master, exp_avg, exp_avg_sq and grad must be four "
            "different tensors, but two of them share memory; pass separate buffers"
        )
