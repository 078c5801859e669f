"""The native kernels: C++ (tiermem/optim/kernels/csrc/*.py) built on first use with the C++ compiler
torch.compile uses, cached on disk, and called through ctypes.

Why C++ and not torch.compile, as the fp32 Adam kernel is: the 8-bit kernel needs a block reduction
between reading and writing each block and many small table-like lookups, which inductor turns into
scalar gathers and a materialised buffer (measured 0.12 Gparam/s, a tenth of the fp32 kernel); and one
small library serves every dtype combination and hyperparameter of every family, so the first use of
a kernel costs one compile of a few seconds rather than one inductor compile per variant. The loops
are plain C++ that GCC vectorises, with AVX-512 intrinsics where the quantizer needs permutes.

A library is built once per machine (the source, the flags and the CPU are the cache key; a new
file is renamed into place, so concurrent builds are safe) and loaded once per process. ctypes
releases the GIL while a kernel runs. Threads: OpenMP (the libgomp torch loaded), as many as
``torch.get_num_threads()``; below PAR_MIN elements a call runs on one thread.
``TIERMEM_NO_COMPILE=1`` turns the native kernels off, as it does the compiled one: the reference
kernels run instead.
"""

from __future__ import annotations

import ctypes
import functools
import getpass
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from tiermem.optim.kernels.compiled import disabled_by_env
from tiermem.optim.kernels.csrc import (
    adam8bit as _csrc_adam8bit,
    common as _csrc_common,
    elementwise as _csrc_elementwise,
    factored as _csrc_adafactor,
)

log = logging.getLogger(__name__)

#: dtype codes of the C++ dispatch (TM_GRAD / TM_OUT / TM_MASTER); -1 is "no tensor"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ("-O2", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC")

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ELEMENTWISE = {  # name -> argtypes
    "tm_any_nonfinite": [_P, _I32, _I64, _I32],
    "tm_sgd": [_I64, _P, _I32, _P, _P, _I32, _P, _I32, _P, _P, _I32],
    "tm_adagrad": [_I64, _P, _I32, _P, _P, _I32, _P, _I32, _P, _P, _I32],
    "tm_lion": [_I64, _P, _I32, _P, _P, _I32, _P, _I32, _P, _P, _I32],
    "tm_adam": [_I64, _P, _I32, _P, _P, _P, _I32, _P, _I32, _P, _P, _I32],
    "tm_streams": [_I64, _P, _I32, _P, _P, _P, _I32, _P, _I32, _P, _I32],
}
_ADAM8BIT = {
    "tm_adam8bit": [_I64, _P, _I32, _P, _P, _P, _P, _P, _I32, _P, _I32, _P, _P, _P, _I32],
    "tm_streams8": [_I64, _P, _I32, _P, _P, _P, _P, _P, _I32, _P, _I32, _P, _I32],
    "tm_quantize": [_I64, _P, _I32, _P, _P, _P, _I32],
    "tm_dequantize": [_I64, _P, _P, _I32, _P, _P, _I32],
}
_D = ctypes.c_double
_ADAFACTOR = {
    "tm_adafactor_stats": [_I64, _I64, _I64, _P, _I32, _P, _I32, _P, _P, _P, _P, _I32],
    "tm_adafactor_rms": [_I64, _I64, _I64, _P, _I32, _P, _P, _I32],
    "tm_adafactor_apply": [_I64, _I64, _I64, _P, _I32, _P, _I32, _P, _I32, _P, _P, _P, _I32],
    "tm_adafactor_vec_stats": [_I64, _P, _I32, _P, _I32, _P, _P, _P, _P, _I32],
    "tm_adafactor_vec_apply": [_I64, _P, _I32, _P, _I32, _P, _I32, _P, _P, _P, _I32],
    "tm_adafactor_floor": [_I64, _P, _I32, _P, _I32, _P, _I32, _P, _I32],
}
_RESTYPES = {"tm_any_nonfinite": ctypes.c_int, "tm_adafactor_rms": _D, "tm_adafactor_floor": _D}
LIBRARIES = {
    "elementwise": ((_csrc_common.SOURCE, _csrc_elementwise.ADAM_MATH, _csrc_elementwise.SOURCE), _ELEMENTWISE),
    "adam8bit": ((_csrc_common.SOURCE, _csrc_elementwise.ADAM_MATH, _csrc_adam8bit.SOURCE), _ADAM8BIT),
    "adafactor": ((_csrc_common.SOURCE, _csrc_adafactor.SOURCE), _ADAFACTOR),
}


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (no compiler, a build error, turned off)."""


class _Library:
    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._lib: Optional[ctypes.CDLL] = None
        self.failure: Optional[str] = None
        self.seconds: Optional[float] = None  # build (or cache load) time in this process

    def get(self) -> ctypes.CDLL:
        if disabled_by_env():
            raise NativeUnavailable("TIERMEM_NO_COMPILE is set")
        if self._lib is not None:
            return self._lib
        with self._lock:
            if self._lib is None:
                if self.failure is not None:
                    raise NativeUnavailable(self.failure)
                t0 = time.perf_counter()
                try:
                    lib = _load(self.name)
                except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                    lines = str(e).strip().splitlines() or [""]
                    why = next((ln for ln in lines if "error" in ln), lines[0])
                    self.failure = f"{type(e).__name__}: {why.strip()[:300]}"
                    log.warning(
                        "tiermem: building the native optimizer kernels (%s) failed, so the slower "
                        "reference kernels run: %s",
                        self.name,
                        self.failure,
                    )
                    raise NativeUnavailable(self.failure) from e
                self.seconds = time.perf_counter() - t0
                log.info("tiermem: native optimizer kernels (%s) ready in %.1f s", self.name, self.seconds)
                self._lib = lib
        return self._lib


_LIBS = {name: _Library(name) for name in LIBRARIES}


def library(name: str) -> ctypes.CDLL:
    """The loaded library ``name`` (built on first use); raises :class:`NativeUnavailable`."""
    return _LIBS[name].get()


def available(name: str) -> bool:
    try:
        library(name)
    except NativeUnavailable:
        return False
    return True


# NOTE [Native build without inductor]
# The compiler and the cache directory are the ones torch.compile uses here, found the way inductor
# finds them (torch/_inductor/cpp_builder.py and runtime/cache_dir_utils.py): ``$CXX``, else g++
# (clang++ on macOS) where it runs; ``$TORCHINDUCTOR_CACHE_DIR``, else ``torchinductor_<user>`` in the
# temporary directory. Found here, not by calling inductor: importing any ``torch._inductor`` module
# imports torch._dynamo with it, ~1.8 CPU s in every process that takes a step and never compiles.
def _compiler() -> str:
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    names = ("clang++", "g++", "c++") if sys.platform == "darwin" else ("g++", "c++", "clang++")
    return next((n for n in names if shutil.which(n)), names[0])


def _cache_dir() -> Path:
    env = os.environ.get("TIERMEM_KERNEL_CACHE")
    if env:
        return Path(env)
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:  # beside inductor's own cache, so clearing that one clears this one
        return Path(inductor).absolute() / "tiermem"
    try:
        user = getpass.getuser()
    except (KeyError, ImportError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}" / "tiermem"


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def portable_library(name: str) -> ctypes.CDLL:
    """The library ``name`` built with its portable scalar paths only (``-DTM_PORTABLE``: no AVX-512 or
    AVX2 intrinsics), which the tests compare with the vector paths bit for bit. Not cached in memory."""
    try:
        return _load(name, ("-DTM_PORTABLE",))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        raise NativeUnavailable(str(e)) from e


def _load(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    sources, functions = LIBRARIES[name]
    source = "\n".join(sources)
    compiler = _compiler()
    flags = (*FLAGS, *extra_flags)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([source, " ".join(flags), compiler, version, _cpu_fingerprint()]).encode())
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"tiermem_{name}_{key.hexdigest()[:24]}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src = Path(tmp) / f"{name}.cpp"
            src.write_text(source)
            out = Path(tmp) / "lib.so"
            res = subprocess.run(
                [compiler, *flags, str(src), "-o", str(out)], capture_output=True, text=True, timeout=600
            )
            if res.returncode != 0:
                raise RuntimeError(f"{compiler} failed:\n{res.stderr.strip()[-4000:]}")
            os.replace(out, path)  # atomic: another process sees the old state or the whole library
    lib = ctypes.CDLL(str(path))
    for fn, argtypes in functions.items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = _RESTYPES.get(fn)
    return lib


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def code(t: Optional[torch.Tensor]) -> int:
    return -1 if t is None else DTYPE_CODES[t.dtype]


def floats(values: list[float]) -> ctypes.Array:
    return _float_array(len(values))(*values)


@functools.cache
def _float_array(n: int) -> type[ctypes.Array]:
    """ctypes' array type of ``n`` floats, made once: made per call, it was garbage after each step
    (CPython 3.11), and a class is a reference cycle only the GC collects (tests/test_activations.py:
    a step leaves no cycle)."""
    return ctypes.c_float * n


_KEYS = ctypes.c_uint32 * 3  # one class, made once (as _float_array: no class, so no cycle, per call)


def keys(values: Optional[tuple[int, int, int]]) -> Optional[ctypes.Array]:
    """The stochastic-rounding keys as the kernels take them (None: round to nearest)."""
    return None if values is None else _KEYS(*values)


def threads() -> int:
    return torch.get_num_threads()


def any_nonfinite(grad: torch.Tensor) -> bool:
    """Whether the flat contiguous CPU tensor ``grad`` holds an inf or NaN (one read, by bits)."""
    return bool(
        library("elementwise").tm_any_nonfinite(grad.data_ptr(), DTYPE_CODES[grad.dtype], grad.numel(), threads())
    )
