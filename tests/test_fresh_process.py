"""What a fresh process that trains pays for: NOTE [Construction without dynamo] in
tiermem/model/torch_optimizer.py and NOTE [Native build without inductor] in tiermem/optim/kernels/native.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tiermem.optim.kernels import native as _native

TRAIN = """
import sys, torch
from tiermem import AdamW, TieredModel
from tiermem.policies import ZeroOffload
from tiermem.optim import implementation
tm = TieredModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)), ZeroOffload(),
                 optimizer=AdamW(lr=1e-2), precision="fp32", grad_clip=1.0)
sched = torch.optim.lr_scheduler.LambdaLR(tm.optimizer, lambda s: 1.0 / (1 + s))
for _ in range(2):
    tm.backward(tm(torch.randn(4, 8)).square().mean())
    tm.step()
    sched.step()
tm.save(sys.argv[1])
assert implementation() == "native", implementation()
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_training_under_zero_offload_imports_neither_dynamo_nor_inductor(tmp_path):
    """Building, two steps with a scheduler, the native Adam and a save: none of it needs dynamo,
    whose import costs a process that never compiles ~1.8 CPU s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("TIERMEM_NO_COMPILE", None)
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, str(tmp_path / "ckpt")], env=env, timeout=300, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_native_build_finds_inductors_compiler_and_cache(monkeypatch, tmp_path):
    """The compiler and the cache directory, found without importing inductor, are inductor's."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for var in ("CXX", "TIERMEM_KERNEL_CACHE", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(var, "-")  # so the teardown restores the variable as it was, set or not
        monkeypatch.delenv(var)
    assert _native._compiler() == get_cpp_compiler()
    assert _native._cache_dir() == Path(cache_dir()) / "tiermem"  # cache_dir() sets the variable
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    assert _native._cache_dir() == Path(cache_dir()) / "tiermem" == tmp_path / "ind" / "tiermem"
    monkeypatch.setenv("TIERMEM_KERNEL_CACHE", str(tmp_path / "own"))
    assert _native._cache_dir() == tmp_path / "own"
    monkeypatch.setenv("CXX", "my-c++")
    assert _native._compiler() == "my-c++"
