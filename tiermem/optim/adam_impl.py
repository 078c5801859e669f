"""Which CPU Adam implementation ``adam_step`` runs (NOTE [Native default]): the native C++ single
pass where its library builds, else the torch.compile'd one, else torch's fused AdamW with
conversions; running the chosen kernel, building or compiling ahead (``warm_up``), and saying once
per process which one runs.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from tiermem.errors import TierMemError
from tiermem.optim.adam_hyper import AdamHyper
from tiermem.optim.arg_checks import GRAD_DTYPES, OUT_DTYPES, check_dtype
from tiermem.optim.kernels import compiled as _compiled, dispatch as _run, eager as _kernels, native as _native
from tiermem.optim.kernels.eager import AdamTensors

log = logging.getLogger(__name__)

_COMPILED = _compiled.CompiledAdam()
_said = threading.Lock()
_said_which: set[str] = set()


def choose(impl: Optional[str], tensors: AdamTensors) -> tuple[str, AdamTensors]:
    """Which kernel runs, and the tensors (:data:`AdamTensors`, detached) to hand it: viewed as 1-D
    where the kernel needs flat tensors, as they are where it takes any strides."""
    master = tensors[0]
    if master.device.type != "cpu":  # optimizer state on an accelerator: torch's fused kernel there
        return "device", tensors
    if not all(t is None or t.is_contiguous() for t in tensors):
        return "reference", tensors  # elementwise ops work on any strides; only the reference takes them
    name = impl if impl is not None else default_impl()
    return name, tuple(None if t is None else t.view(-1) for t in tensors)  # type: ignore[return-value]  # the five, flat


def native_step(tensors: AdamTensors, hyper: AdamHyper, *, check_finite: bool, impl: Optional[str]) -> Optional[bool]:
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


def compiled_step(tensors: AdamTensors, hyper: AdamHyper, *, check_finite: bool, impl: Optional[str]) -> Optional[bool]:
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


def eager_step(name: str, tensors: AdamTensors, hyper: AdamHyper, *, check_finite: bool, impl: Optional[str]) -> bool:
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
    default = default_impl() if grad.is_contiguous() and grad.dtype in GRAD_DTYPES else "fallback"
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
    if default_impl() == "compiled" and not _COMPILED.seconds():
        warm_up()
    return default_impl()


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
        check_dtype("grad", g, GRAD_DTYPES)
    for o in out_dtypes:
        if o is not None:
            check_dtype("out", o, OUT_DTYPES)
    if default_impl() == "native":  # one library serves every variant: nothing to compile
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
def default_impl() -> str:
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
