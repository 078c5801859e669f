"""Shared test setup: tests marked ``cuda`` need an accelerator and are skipped without one; the
session's caches (the machine profile) live in a temporary directory, never the user's home."""

from __future__ import annotations

import os
import sys

# NOTE [Idle OpenMP threads sleep]
# torch's intra-op threads are OpenMP's (libgomp). Left to its default, a worker that finishes a
# parallel region spins for a while before it sleeps; the suite's tiny models run one short op after
# another, so the second core's thread spins nearly all the time: CPU seconds that compute nothing
# and, on a loaded machine, a core taken from whatever else runs (measured per test: a small model's
# training test 3.1 -> 0.4 CPU s). PASSIVE makes it sleep at once. It changes no number: the
# thread count and each op's partition of work stay as they are (tests/test_golden.py's fingerprint
# of this machine's arithmetic is the same). libgomp reads it once, when torch loads it, hence here
# before the first `import torch`; the processes the tests start (examples, ranks, the CLI) inherit
# it. A value the user set is kept.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared small models in models.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (this machine has none)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _cache_in_a_temporary_directory(tmp_path_factory):
    """``XDG_CACHE_HOME`` (where tiermem keeps the machine profile: tiermem.plan.profile) in a
    directory of this session, for the tests and every process they start: the suite neither reads
    a profile the user measured nor writes over it, and runs as on a clean machine (the profile is
    measured once, by the first test that needs it). The kernel caches stay where they are (beside
    inductor's, in the temporary directory): a build is per machine, not per session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models: one intra-op thread runs them faster than two, far faster on a
    loaded machine (a 32x32 bf16 linear: ~66 us with one thread, ~1.7 ms with two, measured while
    other jobs ran). The thread count never changes which numbers a test compares."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
