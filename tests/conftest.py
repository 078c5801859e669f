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
