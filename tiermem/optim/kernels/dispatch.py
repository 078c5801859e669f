"""What every functional entry of the SGD / Adagrad / Lion / 8-bit Adam / bf16-master Adam family
shares: checking the tensors, the finite check, and choosing and calling a kernel.

Kernels: "native" (tiermem/optim/kernels/native.py, the default on the CPU) and "reference"
(tiermem/optim/kernels/reference.py: torch ops, for accelerator tensors, non-contiguous ones, and where the
native kernels cannot be built). Both take flat views in one signature,
``kernel(master, state, grad, out, hyper, sr)``, and give the same bits.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from tiermem.errors import ConfigError, TierMemError
from tiermem.optim.hypers import adam_scalars
from tiermem.optim.kernels import (
    eager as _kernels,
    native as _native,
    quant as _quant,
    reference as _reference,
    sr as _sr,
)

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("native", "reference")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MASTER_DTYPES = (torch.float32, torch.bfloat16)
_said: set[str] = set()
_said_lock = threading.Lock()


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a kernel: its name (in errors), dtype, and element count given the master's
    (None: optional, e.g. SGD's buffer without momentum)."""

    name: str
    dtype: torch.dtype
    numel: Callable[[int], int] = lambda n: n


@dataclass(frozen=True)
class Kernel:
    name: str  # the functional entry, as errors name it
    states: tuple[StateSpec, ...]
    reference: Callable
    native: Callable  # (lib, n, master, state, grad, out, s, sr) -> NativeCall
    scalars: Callable = lambda hyper: []  # the native kernel's scalars of the hyperparameters
    library: str = "elementwise"


NativeCall = tuple[Callable[..., Any], tuple]  # a native kernel's function and its arguments


# The native calls, in one signature: (lib, n, master, state, grad, out, s, sr) -> (function, arguments), s
# the kernel's scalars as a ctypes array (Kernel.scalars of the hyperparameters), sr the rounding keys or
# None. Made first and called after (NOTE [Drop-in speed] in cpu_adam.py: a drop-in makes every call
# of a step before it runs the first).
def _call_sgd(lib, n, master, state, grad, out, s, sr) -> NativeCall:
    P, C, K = _native.ptr, _native.code, _native.keys
    args = (n, P(master), C(master), P(state[0]), P(grad), C(grad), P(out), C(out), s, K(sr), _native.threads())
    return lib.tm_sgd, args


def _call_adagrad(lib, n, master, state, grad, out, s, sr) -> NativeCall:
    P, C, K = _native.ptr, _native.code, _native.keys
    args = (n, P(master), C(master), P(state[0]), P(grad), C(grad), P(out), C(out), s, K(sr), _native.threads())
    return lib.tm_adagrad, args


def _call_lion(lib, n, master, state, grad, out, s, sr) -> NativeCall:
    P, C, K = _native.ptr, _native.code, _native.keys
    args = (n, P(master), C(master), P(state[0]), P(grad), C(grad), P(out), C(out), s, K(sr), _native.threads())
    return lib.tm_lion, args


def _call_adam(lib, n, master, state, grad, out, s, sr) -> NativeCall:
    P, C, K = _native.ptr, _native.code, _native.keys
    args = (
        n,
        P(master),
        C(master),
        P(state[0]),
        P(state[1]),
        P(grad),
        C(grad),
        P(out),
        C(out),
        s,
        K(sr),
        _native.threads(),
    )
    return lib.tm_adam, args


def _call_adam8bit(lib, n, master, state, grad, out, s, sr) -> NativeCall:
    P, C, K = _native.ptr, _native.code, _native.keys
    args = (
        n,
        P(master),
        C(master),
        *(P(t) for t in state),
        P(grad),
        C(grad),
        P(out),
        C(out),
        s,
        P(_quant.CONSTANTS),
        K(sr),
        _native.threads(),
    )
    return lib.tm_adam8bit, args


def _scalars(hyper) -> list[float]:
    return hyper.scalars()


_BLOCKS = _quant.num_blocks
SGD = Kernel("sgd_step", (StateSpec("momentum_buffer", torch.float32),), _reference.sgd, _call_sgd, _scalars)
ADAGRAD = Kernel("adagrad_step", (StateSpec("state_sum", torch.float32),), _reference.adagrad, _call_adagrad, _scalars)
LION = Kernel("lion_step", (StateSpec("exp_avg", torch.float32),), _reference.lion, _call_lion, _scalars)
ADAM = Kernel(
    "adam_step",
    (StateSpec("exp_avg", torch.float32), StateSpec("exp_avg_sq", torch.float32)),
    _reference.adam,
    _call_adam,
    adam_scalars,
)
ADAM8BIT = Kernel(
    "adam8bit_step",
    (
        StateSpec("exp_avg", torch.uint8),
        StateSpec("exp_avg_absmax", torch.float32, _BLOCKS),
        StateSpec("exp_avg_sq", torch.uint8),
        StateSpec("exp_avg_sq_absmax", torch.float32, _BLOCKS),
    ),
    _reference.adam8bit,
    _call_adam8bit,
    adam_scalars,
    library="adam8bit",
)


def native_library(kernel: Kernel) -> Optional[ctypes.CDLL]:
    """The loaded library of ``kernel``'s native call, or None where it cannot be built (the drop-ins
    ask once a step, not once a tensor)."""
    try:
        return _native.library(kernel.library)
    except _native.NativeUnavailable:
        return None


def native_call(
    kernel: Kernel,
    lib: ctypes.CDLL,
    master: torch.Tensor,
    state: Sequence[Optional[torch.Tensor]],
    grad: torch.Tensor,
    s: ctypes.Array,
    keys: Optional[tuple[int, int, int]],
) -> Optional[NativeCall]:
    """The drop-ins' path: their parameters and state were checked when made, so only what a step can
    change is (the gradient; contiguity): the call of the native kernel of ``lib``
    (:func:`native_library`), with the scalars ``s`` already made, to make when it can run; None when
    the checked :func:`run` must."""
    n = master.numel()
    if not (
        n
        and grad.dtype in GRAD_DTYPES
        and grad.is_cpu  # (not grad.device.type: that makes a device object, a microsecond a tensor)
        and grad.numel() == n
        and grad.is_contiguous()
        and master.is_contiguous()
        and all(t is None or t.is_contiguous() for t in state)
    ):
        return None
    check_native(kernel, master, state)
    return kernel.native(lib, n, master, state, grad, None, s, keys)


def check_native(kernel: Kernel, master: torch.Tensor, state: Sequence[Optional[torch.Tensor]]) -> None:
    """What a native kernel reads as raw memory, checked at its boundary (the C++ sees pointers only):
    the master's dtype, and each state tensor's dtype and element count as ``kernel`` declares them. A
    wrong one is a clear error here, never memory written past a buffer."""
    n = master.numel()
    if master.dtype not in MASTER_DTYPES:
        raise ConfigError(f"tiermem: {kernel.name} master has dtype {master.dtype}; it must be fp32 (or bf16)")
    for spec, t in zip(kernel.states, state):
        if t is not None and (t.dtype != spec.dtype or t.numel() != spec.numel(n) or not t.is_cpu):
            raise ConfigError(
                f"tiermem: {kernel.name} {spec.name} is a {t.dtype} tensor of {t.numel()} elements on "
                f"{t.device}; the native kernel reads a {spec.dtype} CPU tensor of {spec.numel(n)}; pass "
                f"state laid out for this tensor (tiermem.optim.state_layout)"
            )


def run(
    kernel: Kernel,
    master: torch.Tensor,
    state: Sequence[Optional[torch.Tensor]],
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
    hyper,
    *,
    stochastic_round: Optional[_sr.StochasticRound],
    check_finite: bool,
    impl: Optional[str],
) -> bool:
    """Check, choose, check the gradient is finite, update with ``hyper`` (checked when it was made; its
    ``step`` keys the stochastic rounding). Returns found_inf (nothing written)."""
    where = f"{kernel.name} "
    _check_impl(where, impl)
    _check_tensors(kernel, master, state, grad, out)
    _sr.check(master, stochastic_round, where)
    detached = [None if t is None else t.detach() for t in (master, *state, grad, out)]
    master, state, grad, out = detached[0], detached[1:-2], detached[-2], detached[-1]  # type: ignore[assignment]  # (master, grad: tensors)
    if master.numel() == 0:
        return False
    keys = None if stochastic_round is None else stochastic_round.keys(hyper.step)
    flat = all(t is None or t.is_contiguous() for t in (master, *state, grad, out))
    lib = choose_native(where, kernel.library, impl, master, flat)
    if check_finite and any_nonfinite(grad):
        return True
    if flat:  # every kernel takes flat views; the reference takes any strides where shapes agree
        views = [None if t is None else t.view(-1) for t in (master, *state, grad, out)]
        master, state, grad, out = views[0], views[1:-2], views[-2], views[-1]  # type: ignore[assignment]  # (as above)
    elif any(t is not None and t.shape != master.shape for t in state):
        raise ConfigError(
            f"tiermem: {where}got non-contiguous tensors with state of another shape than master; "
            f"pass contiguous tensors"
        )
    if lib is not None:
        fn, args = kernel.native(
            lib, master.numel(), master, state, grad, out, _native.floats(kernel.scalars(hyper)), keys
        )
        fn(*args)
    else:
        if impl is None and master.device.type == "cpu" and flat:
            _say_once(kernel.library)
        kernel.reference(master, tuple(state), grad, out, hyper, keys)
    return False


def choose_native(
    where: str, library: str, impl: Optional[str], master: torch.Tensor, flat: bool
) -> Optional[ctypes.CDLL]:
    """The native library a functional entry runs, or None for the reference kernel: ``impl="native"``
    takes contiguous CPU tensors and a build (else a clear error); ``impl=None`` runs native where
    both hold."""
    on_cpu = master.device.type == "cpu"
    if impl is None:
        return _native.library(library) if on_cpu and flat and _native.available(library) else None
    if impl != "native":
        return None
    if not (on_cpu and flat):
        raise ConfigError(f"tiermem: {where}impl='native' takes contiguous CPU tensors; pass impl=None")
    try:
        return _native.library(library)
    except _native.NativeUnavailable as e:
        raise TierMemError(
            f"tiermem: the native CPU optimizer kernels are unavailable here ({e}); install a "
            f"C++ compiler (g++ 12 or newer), or pass impl=None"
        ) from e


def any_nonfinite(grad: torch.Tensor) -> bool:
    """Whether ``grad`` holds an inf or NaN: one read, by the native check where it runs, else
    by torch ops (the native kernels and this check are built together: one unavailable, both are)."""
    if grad.numel() and grad.device.type == "cpu" and grad.is_contiguous() and grad.dtype in GRAD_DTYPES:
        try:
            return _native.any_nonfinite(grad.view(-1))
        except _native.NativeUnavailable:
            pass
    return _kernels._eager_any_nonfinite(grad)


def _say_once(library: str) -> None:
    with _said_lock:
        if library in _said:
            return
        _said.add(library)
    log.warning("tiermem: the %s optimizer kernels run as torch ops (slower): the native ones are unavailable", library)


def _check_impl(where: str, impl: Optional[str]) -> None:
    if impl is not None and impl not in IMPLEMENTATIONS:
        raise ConfigError(f"tiermem: {where}impl={impl!r} is unknown; pass one of {IMPLEMENTATIONS} or None")


def _check_tensors(
    kernel: Kernel,
    master: torch.Tensor,
    state: Sequence[Optional[torch.Tensor]],
    grad: torch.Tensor,
    out: Optional[torch.Tensor],
) -> None:
    where = f"{kernel.name} "
    named: dict[str, tuple[torch.Tensor, Optional[torch.dtype], Optional[int]]] = {}
    if not isinstance(master, torch.Tensor):
        raise ConfigError(f"tiermem: {where}master is a {type(master).__name__}, not a tensor; pass a tensor")
    n = master.numel()
    for spec, t in zip(kernel.states, state):
        if t is not None:
            named[spec.name] = (t, spec.dtype, spec.numel(n))
    named["grad"] = (grad, None, n)
    if out is not None:
        named["out"] = (out, None, n)
    for name, (t, dtype, numel) in named.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tiermem: {where}{name} is a {type(t).__name__}, not a tensor; pass a tensor")
        if t.device != master.device or t.device.type == "meta":
            raise ConfigError(
                f"tiermem: {where}{name} is on {t.device} but master is on {master.device}; all "
                f"tensors must be on one CPU or accelerator device; move them there"
            )
        if dtype is not None and t.dtype != dtype:
            raise ConfigError(f"tiermem: {where}{name} has dtype {t.dtype}; it must be {dtype}")
        if name in ("grad", "out") and t.shape != master.shape:
            raise ConfigError(
                f"tiermem: {where}{name} has shape {tuple(t.shape)} but master has "
                f"{tuple(master.shape)}; pass tensors of one shape"
            )
        if t.numel() != numel:
            raise ConfigError(
                f"tiermem: {where}{name} has {t.numel()} elements but master's {n} need {numel}; "
                f"pass state laid out for this tensor (tiermem.optim.state_layout)"
            )
    if grad.dtype not in GRAD_DTYPES:
        raise ConfigError(
            f"tiermem: {where}grad has dtype {grad.dtype}; it must be one of "
            f"{', '.join(str(d) for d in GRAD_DTYPES)}; convert it first"
        )
    if out is not None and out.dtype not in GRAD_DTYPES:
        raise ConfigError(
            f"tiermem: {where}out has dtype {out.dtype}; it must be one of {', '.join(str(d) for d in GRAD_DTYPES)}"
        )
    ptrs = [t.data_ptr() for t, _, _ in named.values() if t.numel()] + ([master.data_ptr()] if n else [])
    if len(set(ptrs)) != len(ptrs):
        raise ConfigError(
            f"tiermem: {where}master, the state tensors, grad and out must be different tensors, "
            f"but two of them share memory; pass separate buffers"
        )
