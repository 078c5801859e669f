"""Shared test setup: tests marked ``cuda`` need an accelerator and are skipped without one."""

from __future__ import annotations

import os
import sys

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


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models: one intra-op thread runs them faster than two, far faster on a
    loaded machine (a 32x32 bf16 linear: ~66 us with one thread, ~1.7 ms with two, measured while
    other jobs ran). The thread count never changes which numbers a test compares."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
