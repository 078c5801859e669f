"""tiermem's stages as spans of a user's ``torch.profiler`` trace.

# NOTE [tiermem in the torch profiler]
Every stage tiermem traces (``trace_path``: the forward and backward it wraps, grads copied home,
Adam per bucket, weights uploaded, NVMe reads and writes, weights prefetched, the waits of the
step) is also a ``torch.profiler.record_function`` span named ``tiermem::<stage>``, so a
``torch.profiler.profile()`` shows them beside the model's own ops, and on a GPU beside the copies
and kernels they launched. Stages that run on the calling thread (forward, backward, the step, Adam,
the waits) appear in any profile. Transfers run on tiermem's own threads (one lane per direction,
the NVMe I/O threads), which the profiler records only when asked to record every thread:
``torch.profiler.profile(experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True))``.
A lane's request is ``tiermem::d2h``, ``tiermem::h2d``, ``tiermem::nvme`` or ``tiermem::compute``,
holding what it does (``tiermem::copy grad device->host``, ``tiermem::nvme read bucket2:state``); on
a GPU the host side of a copy that landed (a gradient converted into its fp32 buffer) is
``tiermem::d2h landed``.
Without a profiler running a span costs one attribute read: :func:`span` hands back a shared
no-op context and builds no name.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch.autograd import profiler as _autograd_profiler

PREFIX = "tiermem::"

_NOTHING = contextlib.nullcontext()  # reusable: it holds no state


def profiling() -> bool:
    """Whether a torch profiler runs (on any thread: the flag is the process's, set by
    ``profile.__enter__``; torch versions without it are treated as always profiling)."""
    return getattr(_autograd_profiler, "_is_profiler_enabled", True)


def span(name: str) -> ContextManager[object]:
    """``record_function("tiermem::<name>")`` while a profiler runs, else a no-op."""
    if not profiling():
        return _NOTHING
    return torch.profiler.record_function(PREFIX + name)


def lazy_span(name: Callable[[], str]) -> ContextManager[object]:
    """:func:`span` with the name built only while a profiler runs (a name with a key in it)."""
    if not profiling():
        return _NOTHING
    return torch.profiler.record_function(PREFIX + name())
