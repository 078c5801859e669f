"""precision="auto" (NOTE [Choosing the precision] in tiermem/config/precision.py) and the matmul figures behind
the warning for a precision the CPU is slow at (NOTE [A precision the CPU is slow at] in
tiermem/model/compute.py), with the CPU's features and the measured figures made up."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from models import TinyGPT, train_steps
from torch import nn

from tiermem import AdamW, ConfigError, TieredModel
from tiermem.cli import main
from tiermem.config.specs import CpuFeatures, auto_precision, resolve_precision
from tiermem.model import compute
from tiermem.plan import profile

CPU = torch.device("cpu")
AVX2 = CpuFeatures("AVX2", avx512_bf16=False, amx=False)
AVX512_BF16 = CpuFeatures("AVX512", avx512_bf16=True, amx=False)


@pytest.mark.parametrize(
    "cpu, native",
    [
        (AVX2, False),
        (CpuFeatures("DEFAULT", avx512_bf16=False, amx=False), False),  # ARM, or no vector unit torch knows
        (CpuFeatures("AVX512", avx512_bf16=False, amx=False), False),  # Skylake: AVX-512 without its bf16
        (AVX512_BF16, True),  # Cooper Lake, Zen 4
        (CpuFeatures("AVX512", avx512_bf16=False, amx=True), True),  # AMX tiles (Sapphire Rapids)
        # ATEN_CPU_CAPABILITY=avx2 caps ATen's own kernels, not oneDNN's matmul: still fast
        (CpuFeatures("AVX2", avx512_bf16=True, amx=True), True),
        (CpuFeatures("AVX512", avx512_bf16=True, amx=True, onednn=False), False),  # no oneDNN: no fast bf16 matmul
        (CpuFeatures("AVX512", avx512_bf16=True, amx=False, onednn_max_isa="AVX2"), False),  # oneDNN capped
        (CpuFeatures("AVX512", avx512_bf16=True, amx=False, onednn_max_isa="avx512_core"), False),
        (CpuFeatures("AVX512", avx512_bf16=True, amx=False, onednn_max_isa="AVX512_CORE_BF16"), True),
        (CpuFeatures("AVX512", avx512_bf16=True, amx=True, onednn_max_isa="ALL"), True),
    ],
)
def test_a_cpu_computes_bf16_natively_only_with_its_instructions_in_reach(cpu, native):
    assert cpu.native_bf16 is native
    assert auto_precision(CPU, cpu=cpu)[0] == ("bf16" if native else "fp32")  # never fp16 on a CPU
    assert resolve_precision("auto", CPU, cpu=cpu) == ("bf16" if native else "fp32")


@pytest.mark.parametrize(
    "capability, precision", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"), ((7, 0), "fp16")]
)
def test_auto_on_a_gpu_is_bf16_from_ampere_on_and_fp16_before(monkeypatch, capability, precision):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got, why = auto_precision(torch.device("cuda"))
    assert got == precision and f"{capability[0]}.{capability[1]}" in why
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert auto_precision(torch.device("cuda"))[0] == "bf16"  # every ROCm device torch runs on has bf16


def test_detect_reads_torch_and_the_onednn_cap(monkeypatch):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    got = CpuFeatures.detect()
    assert got.capability == torch.backends.cpu.get_cpu_capability() and got.onednn_max_isa == "AVX2"
    assert not got.native_bf16
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE")  # oneDNN's older name for the same cap
    assert CpuFeatures.detect().onednn_max_isa == "AVX512_CORE"
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert CpuFeatures.detect() == AVX512_BF16
    with torch.backends.mkldnn.flags(enabled=False):  # the bf16 matmul falls back to torch's slow loops
        assert CpuFeatures.detect() == CpuFeatures("AVX512", True, False, onednn=False)
        assert not CpuFeatures.detect().native_bf16


def test_auto_under_the_avx2_emulation_is_fp32():
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 makes any x86 CPU compute as an AVX2-only one
    (bench/RESULTS.md: a bf16 matmul 8x fp32's time there): a fresh process sees it and picks fp32."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = (
        "import torch; from tiermem.config.specs import CpuFeatures, resolve_precision; f = CpuFeatures.detect(); "
        "print(f.onednn_max_isa, f.native_bf16, resolve_precision('auto', torch.device('cpu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AVX2", "False", "fp32"]


@pytest.mark.parametrize("bad", ["bfloat16", "AUTO", None, 16, torch.bfloat16])
def test_a_precision_that_is_not_one_is_a_one_line_error(bad):
    with pytest.raises(
        ConfigError,
        match=r"^tiermem: precision=.* is not supported; use one of 'bf16', 'fp16', "
        r"'fp32', 'auto'",
    ):
        resolve_precision(bad, CPU)
    with pytest.raises(ConfigError, match=r"^tiermem: precision="):
        TieredModel(nn.Linear(3, 3), precision=bad)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory, and a process that has measured nothing and warned about nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(compute, "_sections", {})
    monkeypatch.setattr(compute, "_warned", set())
    return tmp_path / "cache" / "tiermem" / "profile.json"


def _new_process(monkeypatch) -> None:
    """What a new process starts with: no figures read, no warning given."""
    monkeypatch.setattr(compute, "_sections", {})
    monkeypatch.setattr(compute, "_warned", set())


def _cpu_is(monkeypatch, cpu: CpuFeatures) -> None:
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: cpu))


def _figures(fp32: float, bf16: float, fp16: float) -> dict:
    """A matmul section measured under today's conditions, in GFLOP/s."""
    return {
        "conditions": compute.conditions(CPU),
        "cpu_shape": list(compute.CPU_SHAPE),
        "cpu_threads": 1,
        "cpu_fp32_GFLOPs": fp32,
        "cpu_bf16_GFLOPs": bf16,
        "cpu_fp16_GFLOPs": fp16,
    }


def _model(precision: str) -> TieredModel:
    torch.manual_seed(0)
    return TieredModel(TinyGPT(), optimizer=AdamW(lr=1e-2), precision=precision)


@pytest.mark.parametrize("cpu, precision", [(AVX2, "fp32"), (AVX512_BF16, "bf16")])
def test_auto_trains_in_the_precision_this_cpu_computes_fast(fresh, monkeypatch, caplog, cpu, precision):
    _cpu_is(monkeypatch, cpu)
    profile.save_profile({"schema": profile.SCHEMA, "matmul": _figures(60.0, 90.0, 5.0)})  # nothing to measure
    with caplog.at_level(logging.INFO, logger="tiermem"):
        tm = _model("auto")
    assert tm.precision == precision and tm.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    assert {p.dtype for p in tm.module.parameters()} == {tm.dtype}
    assert f"precision={precision!r}" in repr(tm)
    assert f"precision='auto' is {precision!r} on cpu: this CPU" in caplog.text
    assert f"({precision}, from precision='auto')" in caplog.text
    assert len(train_steps(tm, 1)) == 1
    assert "tiermem: precision=" not in "".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_bf16_on_a_cpu_slow_at_it_warns_once_with_both_figures_and_the_fix(fresh, monkeypatch, caplog):
    _cpu_is(monkeypatch, AVX2)
    # the AVX2 EPYC: F.linear 4096x128 by 512x128 took 72.8 ms in bf16, 6.5 ms in fp32
    profile.save_profile({"schema": profile.SCHEMA, "matmul": _figures(82.6, 7.37, 7.0)})
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _model("bf16")
        _model("bf16")  # once per process
    warnings = [r.getMessage() for r in caplog.records if "on this CPU" in r.getMessage()]
    flop = 2 * math.prod(compute.CPU_SHAPE)
    bf16_ms, fp32_ms = flop / 7.37e9 * 1e3, flop / 82.6e9 * 1e3
    assert warnings == [
        f"tiermem: precision='bf16' on this CPU ({AVX2}): a matmul in bf16 takes {bf16_ms:.2f} ms "
        f"against {fp32_ms:.2f} ms in fp32 ({82.6 / 7.37:.1f}x), so forward and backward run about "
        f"that much slower; pass precision='auto' (fp32 on this CPU) or 'fp32' to train faster (the "
        f"optimizer state is fp32 either way)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _model("fp16")  # fp16 is as slow there: its own warning, once
        _model("fp32")
        _model("fp16")
    fp16 = [r.getMessage() for r in caplog.records if "on this CPU" in r.getMessage()]
    assert len(fp16) == 1 and fp16[0].startswith("tiermem: precision='fp16' on this CPU (AVX2 (no AVX512-BF16")


def test_fp16_on_a_cpu_with_fast_bf16_points_to_auto(fresh, monkeypatch, caplog):
    _cpu_is(monkeypatch, AVX512_BF16)
    profile.save_profile({"schema": profile.SCHEMA, "matmul": _figures(50.0, 120.0, 8.0)})
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _model("bf16")  # faster than fp32: nothing to say
        _model("fp16")
    messages = [r.getMessage() for r in caplog.records if "on this CPU" in r.getMessage()]
    assert len(messages) == 1 and "precision='fp16'" in messages[0]
    assert "pass precision='auto' (bf16 on this CPU) or 'fp32'" in messages[0]


def test_a_slowdown_within_the_ratio_is_no_warning(fresh, monkeypatch, caplog):
    _cpu_is(monkeypatch, AVX2)
    fp32 = 40.0
    profile.save_profile({"schema": profile.SCHEMA, "matmul": _figures(fp32, fp32 / compute.SLOW_RATIO, 1.0)})
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _model("bf16")
    assert "on this CPU" not in caplog.text


def test_the_figures_are_measured_once_and_saved_then_read_back(fresh, monkeypatch):
    calls = []
    real = compute.measure_matmul

    def counted(device):
        calls.append(device)
        return real(device)

    monkeypatch.setattr(compute, "measure_matmul", counted)
    _cpu_is(monkeypatch, AVX2)
    _model("bf16")
    _model("bf16")
    assert len(calls) == 1  # the first construction measured; the next read the process's copy
    saved = json.loads(fresh.read_text())
    section = saved["matmul"]
    assert section["conditions"] == compute.conditions(CPU)
    assert all(section[f"cpu_{p}_GFLOPs"] > 0 for p in ("fp32", "bf16", "fp16"))
    assert {"schema", "matmul"} <= set(saved) and "adam" not in saved  # the rest waits for the cost model
    _new_process(monkeypatch)  # reads the saved figures: no measurement
    _model("bf16")
    assert len(calls) == 1
    # Other conditions (another ISA cap) in a new process: the saved figures are stale. (In the same
    # process a CPU slow at bf16 has warned once already and asks for no figures again.)
    _new_process(monkeypatch)
    _cpu_is(monkeypatch, CpuFeatures("AVX2", avx512_bf16=False, amx=False, onednn_max_isa="AVX2"))
    _model("bf16")
    assert len(calls) == 2
    assert json.loads(fresh.read_text())["matmul"]["conditions"]["cpu"]["onednn_max_isa"] == "AVX2"
    _new_process(monkeypatch)
    _model("fp32")  # fp32 warns about nothing, so it needs no figures
    assert len(calls) == 2


def test_a_partial_profile_is_completed_for_the_cost_model(fresh, monkeypatch):
    """The matmul figures saved alone (a first bf16 model) leave the rest of the profile to be measured
    the first time Auto needs it; then every figure is there."""
    from tiermem.model import machine
    from tiermem.policies import Auto

    monkeypatch.setattr(machine, "_BYTES", 2**20)  # a test must not spend long measuring
    monkeypatch.setattr(machine, "_ADAM_PARAMS", 2**14)
    _cpu_is(monkeypatch, AVX2)
    profile.save_profile({"schema": profile.SCHEMA, "matmul": _figures(60.0, 6.0, 5.0)})
    torch.manual_seed(0)
    tm = TieredModel(TinyGPT(), Auto(tokens_per_step=2 * 11), precision="fp32")
    saved = json.loads(fresh.read_text())
    assert saved["adam"]["tiermem_Gparams_per_s"] > 0 and saved["matmul"] == _figures(60.0, 6.0, 5.0)
    stages = tm.placement.chosen.evaluation.stages
    trainable = sum(p.numel() for p in tm.module.parameters())
    assert stages["forward+backward"] == pytest.approx(6 * trainable * 22 / (60e9 * torch.get_num_threads()))


def test_info_prints_the_capability_and_the_slowdowns(fresh, monkeypatch, capsys):
    _cpu_is(monkeypatch, AVX2)
    profile.save_profile({"schema": profile.SCHEMA, "matmul": _figures(80.0, 8.0, 4.0)})
    assert main(["info", "--no-compile-check", "--json", "-"]) == 0
    facts = json.loads(capsys.readouterr().out)["cpu"]
    assert facts["capability"] == "AVX2" and facts["auto_precision"] == "fp32"
    assert facts["vs_fp32"] == {"bf16": 10.0, "fp16": 20.0}
    assert main(["info", "--no-compile-check"]) == 0
    out = capsys.readouterr().out
    assert "AVX2 (no AVX512-BF16, no AMX)" in out and "bf16" in out and "(10.0x fp32)" in out and "(20.0x fp32)" in out
    assert "precision 'auto'" in out and "fp32: this CPU has no fast bf16 matmul" in out


def test_info_on_this_machine_measures_what_torch_reports(fresh, capsys):
    """Nothing made up: the capability is torch's, and the figures are measured and saved."""
    assert main(["info", "--no-compile-check", "--json", "-"]) == 0
    facts = json.loads(capsys.readouterr().out)["cpu"]
    assert facts["capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["auto_precision"] == auto_precision(CPU)[0]
    assert all(ms > 0 for ms in facts["matmul_ms"].values()) and set(facts["vs_fp32"]) == {"bf16", "fp16"}
    assert json.loads(fresh.read_text())["matmul"]["conditions"] == compute.conditions(CPU)
