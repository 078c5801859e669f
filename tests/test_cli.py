"""The `tiermem` command (bench, plan, info) through a subprocess as users run it, and its parts
(parameter counting, the profile, the measurements) in-process against plain-PyTorch oracles."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest
import torch
from fresh import run_python
from hypothesis import given, settings, strategies as st
from torch import nn

from tiermem.cli import main, measure, plot
from tiermem.cli.models import count_config, from_config, from_factory, parse_count
from tiermem.errors import ConfigError
from tiermem.plan import profile
from tiermem.types import Tier

MiB = 2**20


def run_cli(*args: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m tiermem ARGS`` in a process of its own (NOTE [Scripts forked from the forkserver])."""
    return run_python("-m", "tiermem", *args, cwd=cwd, env=env, timeout=timeout)


def start_cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """``python -m tiermem ARGS`` in a fresh interpreter: the exit status and stderr are Python's own."""
    return subprocess.Popen(
        [sys.executable, "-m", "tiermem", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment with the cache (where bench saves its profile) under tmp_path."""
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}


# -- through a subprocess ----------------------------------------------------------------------------
def test_help_for_every_command(tmp_path, env, capsys):
    """``tiermem --help`` through a subprocess as users run it; each command's help in-process (the
    same parser: a process each would cost ~3 CPU seconds of importing torch, for the same text)."""
    expect = {
        (): ["bench", "plan", "info"],
        ("bench",): ["--quick", "--nvme-path", "--json", "--plot", "--no-save"],
        ("plan",): ["--params", "--model", "--config", "--device-mem", "--host-mem", "--nvme-free", "--json"],
        ("info",): ["--nvme-path", "--json"],
    }
    for cmd in expect:
        if cmd:
            with pytest.raises(SystemExit) as e:
                main([*cmd, "--help"])
            code, out = e.value.code, capsys.readouterr().out
        else:
            res = run_cli("--help", cwd=tmp_path, env=env)
            code, out = res.returncode, res.stdout
            assert code == 0, res.stderr
        assert code == 0
        assert out.startswith(f"usage: tiermem{''.join(' ' + c for c in cmd)}")
        for word in expect[cmd]:
            assert word in out, (cmd, word)


def test_console_script_is_main():
    (ep,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "tiermem"]
    assert ep.load() is main


def _at(data: dict, path: str):
    """``data["nvme"]["sweep"][2]["read_GBps"]`` for the path ``nvme.sweep[2].read_GBps``."""
    for part in path.split("."):
        name, _, index = part.partition("[")
        data = data[name]
        if index:
            data = data[int(index.rstrip("]"))]
    return data


def test_bench_quick_json_gives_every_figure_and_saves_the_profile(tmp_path, env):
    work = tmp_path / "work"
    work.mkdir()
    # two samples a figure, not --quick's three: a spread (cv) still, and a third less time waiting on the disk
    res = run_cli("bench", "--quick", "--repeats", "2", "--json", "bench.json", cwd=work, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads((work / "bench.json").read_text())
    for path in [
        "device.h2d_GBps",
        "device.d2h_GBps",
        "device.bidir_GBps",
        "host.copy_GBps",
        "nvme.write_GBps",
        "nvme.read_GBps",
        "nvme.buffered_write_GBps",
        "nvme.buffered_read_GBps",
        "adam.tiermem_Gparams_per_s",
        "adam.torch_fused_Gparams_per_s",
    ]:
        value = _at(data, path)
        assert isinstance(value, float) and value > 0, path
        assert _at(data, path.rsplit("_", 1)[0] + "_cv") >= 0, path
    sweep = data["nvme"]["sweep"]
    assert {(e["block_size_bytes"], e["in_flight"], e["asked_direct"]) for e in sweep} == {
        (MiB, 1, True),
        (MiB, 8, True),
        (8 * MiB, 1, True),
        (8 * MiB, 8, True),
        (8 * MiB, 8, False),
    }
    assert all(e["write_GBps"] > 0 and e["read_GBps"] > 0 for e in sweep)
    assert data["quick"] is True and data["schema"] == profile.SCHEMA
    assert (data["device"]["accelerator"] is None) == (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert "no accelerator" in data["device"]["stand_in"] and "no accelerator" in res.stdout
    for path in data["noisy"]:  # every flag names a figure that exists and whose spread is > 10%
        assert _at(data, path.rsplit("_", 1)[0] + "_cv") > measure.NOISY_CV
    saved = json.loads((tmp_path / "cache" / "tiermem" / "profile.json").read_text())
    assert saved == data
    assert not [p for p in work.iterdir() if p.name.startswith(".tiermem-bench-")]  # scratch removed
    assert "NVMe through NvmeStore" in res.stdout and "CPU Adam" in res.stdout
    assert all(data["matmul"][f"cpu_{p}_GFLOPs"] > 0 for p in ("fp32", "bf16", "fp16"))
    assert "matmul per precision" in res.stdout
    assert data["adam"]["compile_s"] >= 0  # the one-time kernel build, reported apart from the rates
    if plot.matplotlib_available():  # the optional extra: draw this run's figures
        plot.draw(data, str(tmp_path / "tiers.png"))
        assert (tmp_path / "tiers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_json_gives_the_worked_example_exactly(tmp_path, env):
    res = run_cli("plan", "--params", "7.5e9", "--json", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["params"] == {"trainable": 7_500_000_000, "frozen": 0, "total": 7_500_000_000}
    G = 10**9
    for prec in ("bf16", "fp16"):
        p = plan["precisions"][prec]
        assert p["state_bytes"] == {
            "params": 15 * G,
            "grads": 15 * G,
            "master": 30 * G,
            "momentum": 30 * G,
            "variance": 30 * G,
            "total": 120 * G,
        }
        zero = p["policies"]["ZeroOffload"]["tiers"]
        assert (zero["device"]["bytes"], zero["host"]["bytes"], zero["nvme"]["bytes"]) == (15 * G, 120 * G, 0)
        assert p["policies"]["KeepOnDevice"]["tiers"]["device"]["bytes"] == 135 * G  # fp32 grads at home
    assert plan["limits"]["host_bytes"] == psutil.virtual_memory().total
    assert plan["limits"]["nvme_bytes"] > 0


def test_plan_counts_bytes_per_rank(capsys):
    """``--ranks N``: a rank's share: grads and optimizer state 1/N; weights 1/N off the device
    (ZeroInfinity) or with --shard-weights, else whole."""
    G = 10**9
    tiers = {}
    for extra in ([], ["--shard-weights"]):
        assert main(["plan", "--params", "8e9", "--precision", "bf16", "--ranks", "4", *extra, "--json", "-"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["ranks"] == 4
        tiers[bool(extra)] = {
            n: {t: v["bytes"] for t, v in e["tiers"].items()} for n, e in plan["precisions"]["bf16"]["policies"].items()
        }
    assert tiers[False]["ZeroOffload"] == {"device": 16 * G, "host": 32 * G, "nvme": 0}
    assert tiers[False]["ZeroInfinity"] == {"device": 0, "host": 8 * G, "nvme": 28 * G}
    assert tiers[True]["ZeroOffload"] == {"device": 4 * G, "host": 32 * G, "nvme": 0}
    assert main(["plan", "--params", "8e9", "--precision", "bf16", "--ranks", "4", "--policy", "ZeroOffload"]) == 0
    assert "per rank of 4 data-parallel ranks" in capsys.readouterr().out
    assert main(["plan", "--params", "8e9", "--ranks", "0"]) != 0
    assert "--ranks 0 is not a number of ranks" in capsys.readouterr().err


def test_plan_prints_the_worked_example(capsys):
    assert main(["plan", "--params", "7.5e9", "--precision", "bf16", "--policy", "ZeroOffload"]) == 0
    out = capsys.readouterr().out
    for figure in ("15 GB", "30 GB", "120 GB", "15 GB + act."):
        assert figure in out


def test_info_reports_this_machine(tmp_path, env):
    res = run_cli("info", "--json", "--no-compile-check", "--nvme-path", str(tmp_path), cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    facts = json.loads(res.stdout)
    assert facts["torch"] == torch.__version__ and facts["cuda"] == torch.version.cuda
    assert len(facts["device"]["accelerators"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert facts["host"]["total_bytes"] == psutil.virtual_memory().total
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert facts["host"]["memlock_soft_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert facts["nvme"]["path"] == str(tmp_path)
    assert facts["nvme"]["o_direct"] == _o_direct_works(tmp_path)
    assert abs(facts["nvme"]["free_bytes"] - shutil.disk_usage(tmp_path).free) < 2**30
    assert facts["profile"]["path"] == str(tmp_path / "cache" / "tiermem" / "profile.json")


def _o_direct_works(directory: Path) -> bool:
    """Independent oracle: can this directory take a 4096-byte O_DIRECT write from aligned memory?"""
    import mmap

    path = directory / "oracle.bin"
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            return os.write(fd, buf) == 4096
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        path.unlink(missing_ok=True)


def test_info_prints_a_table(capsys, tmp_path):
    assert main(["info", "--no-compile-check", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "host RAM", "pinned limit", "O_DIRECT", "torch.compile"):
        assert word in out


def test_bad_arguments_exit_2_with_one_line_through_a_subprocess(tmp_path, env):
    # one error of ours (a TierMemError) and one of argparse's; the in-process table has the rest
    cases = {
        ("plan", "--params", "7.5e9", "--host-mem", "12XB"): "does not parse as a size",
        ("frobnicate",): "invalid choice: 'frobnicate'",
    }
    procs = {args: start_cli(*args, cwd=tmp_path, env=env) for args in cases}
    for args, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("tiermem: ") and cases[args] in err, err
        assert out == ""


@pytest.mark.parametrize(
    "argv, match",
    [
        (["plan", "--params", "abc"], r"^tiermem: --params 'abc' is not a whole number of parameters"),
        (["plan", "--params", "7.5"], r"^tiermem: --params '7.5' is not a whole number"),
        (["plan", "--params", "-3"], r"^tiermem: --params '-3' is not a whole number"),
        (["plan", "--params", "1e9", "--device-mem", "lots"], r"^tiermem: --device-mem='lots' does not parse"),
        (["plan"], r"^tiermem: one of the arguments --params --model --config is required"),
        (["plan", "--params", "1e9", "--model", "m:f"], r"^tiermem: argument --model: not allowed with"),
        (["plan", "--params", "1e9", "--precision", "fp8"], r"^tiermem: argument --precision: invalid choice"),
        (["plan", "--model", "json"], r"^tiermem: --model 'json' is not 'package.module:factory'"),
        (["plan", "--model", "json:no_such_factory"], r"^tiermem: module 'json' has no attribute"),
        (["plan", "--model", "json:__doc__"], r"^tiermem: --model 'json:__doc__' names a str, not a callable"),
        (["plan", "--model", "json:dumps"], r"^tiermem: calling json:dumps failed: TypeError"),
        (["plan", "--model", "json:JSONDecoder"], r"^tiermem: json:JSONDecoder\(\) returned a JSONDecoder"),
        (["plan", "--config", "/no/such/config.json"], r"^tiermem: cannot read --config '/no/such/config.json'"),
        (["plan", "--params", "1e9", "--nvme-path", "/no/such/dir"], r"^tiermem: --nvme-path '/no/such/dir' is not"),
        (["info", "--nvme-path", "/no/such/dir", "--no-compile-check"], r"^tiermem: --nvme-path '/no/such/dir'"),
        (["bench", "--nvme-path", "/no/such/dir", "--quick"], r"^tiermem: --nvme-path '/no/such/dir' is not an"),
        (["bench", "--json", "/no/such/dir/b.json"], r"^tiermem: --json '/no/such/dir/b.json': directory"),
        (["bench", "--repeats", "0"], r"^tiermem: --repeats 0 must be 1 or more"),
        (["bench", "--repeats", "x"], r"^tiermem: argument --repeats: invalid int value"),
        ([], r"^usage: tiermem"),
    ],
)
def test_bad_arguments_in_process(argv, match, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors leave through exit()
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert __import__("re").search(match, err), err
    if argv:
        assert err.count("\n") == 1, err


def test_bad_config_file_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "partial.json").write_text('{"hidden_size": 8}')
    for name, match in [
        ("bad.json", "is not valid JSON"),
        ("list.json", "holds a list, not a JSON object"),
        ("partial.json", "has none of num_hidden_layers, n_layer, num_layers"),
    ]:
        assert main(["plan", "--config", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tiermem: ") and match in err and err.count("\n") == 1


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["bench", "--quick", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert err == "tiermem: --plot needs matplotlib, which is not installed; pip install 'tiermem[plot]'\n"


# -- parameter counts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, n",
    [
        ("7.5e9", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("125M", 125_000_000),
        ("1000", 1000),
        ("2.5k", 2500),
        ("1.2T", 1_200_000_000_000),
        (" 70b ", 70_000_000_000),
    ],
)
def test_parse_count(text, n):
    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["", "abc", "1.5", "0", "-1", "nan", "inf", "1e", "7.5X", "1e-3"])
def test_parse_count_refuses(text):
    with pytest.raises(ConfigError, match=r"^tiermem: --params .* is not a whole number of parameters"):
        parse_count(text)


class LlamaLike(nn.Module):
    """The Llama/Mistral/Mixtral architecture as torch modules: the oracle for count_config."""

    def __init__(self, c: dict):
        super().__init__()
        h, heads, inter, vocab = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"], c["vocab_size"]
        hd, kv = h // heads, c.get("num_key_value_heads", heads)
        ab, mb, experts = c.get("attention_bias", False), c.get("mlp_bias", False), c.get("num_local_experts", 1)
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = nn.Module()
            layer.q, layer.k = nn.Linear(h, heads * hd, bias=ab), nn.Linear(h, kv * hd, bias=ab)
            layer.v, layer.o = nn.Linear(h, kv * hd, bias=ab), nn.Linear(heads * hd, h, bias=ab)
            layer.experts = nn.ModuleList(
                nn.ModuleDict(
                    {
                        "gate": nn.Linear(h, inter, bias=mb),
                        "up": nn.Linear(h, inter, bias=mb),
                        "down": nn.Linear(inter, h, bias=mb),
                    }
                )
                for _ in range(experts)
            )
            if experts > 1:
                layer.router = nn.Linear(h, experts, bias=False)
            layer.norm1, layer.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        if c.get("tie_word_embeddings", True):
            self.lm_head.weight = self.embed.weight


class GPT2Like(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, vocab, inter = c["n_embd"], c["vocab_size"], c.get("n_inner") or 4 * c["n_embd"]
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(c["n_positions"], h)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln_1": nn.LayerNorm(h),
                    "c_attn": nn.Linear(h, 3 * h),
                    "attn_proj": nn.Linear(h, h),
                    "ln_2": nn.LayerNorm(h),
                    "c_fc": nn.Linear(h, inter),
                    "mlp_proj": nn.Linear(inter, h),
                }
            )
            for _ in range(c["n_layer"])
        )
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        if c.get("tie_word_embeddings", True):
            self.lm_head.weight = self.wte.weight


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 6),
    kv_div=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
    inter=st.integers(1, 40),
    vocab=st.integers(1, 50),
    tied=st.booleans(),
    attention_bias=st.booleans(),
    mlp_bias=st.booleans(),
    experts=st.integers(1, 3),
)
def test_count_config_llama_style_matches_the_modules(
    heads, head_dim, kv_div, layers, inter, vocab, tied, attention_bias, mlp_bias, experts
):
    kv = max(1, heads // kv_div) if heads % kv_div == 0 else heads
    cfg = {
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "attention_bias": attention_bias,
        "mlp_bias": mlp_bias,
        "num_local_experts": experts,
    }
    with torch.device("meta"):
        assert count_config(cfg)[0] == numel(LlamaLike(cfg))


@settings(max_examples=15, deadline=None)
@given(
    h=st.integers(1, 24),
    layers=st.integers(1, 3),
    vocab=st.integers(1, 50),
    positions=st.integers(1, 30),
    inner=st.one_of(st.none(), st.integers(1, 40)),
    tied=st.booleans(),
)
def test_count_config_gpt2_style_matches_the_modules(h, layers, vocab, positions, inner, tied):
    cfg = {
        "model_type": "gpt2",
        "n_embd": h,
        "n_head": 1,
        "n_layer": layers,
        "vocab_size": vocab,
        "n_positions": positions,
        "n_inner": inner,
        "tie_word_embeddings": tied,
    }
    with torch.device("meta"):
        assert count_config(cfg)[0] == numel(GPT2Like(cfg))


@pytest.mark.parametrize(
    "cfg, published",
    [
        # published parameter counts of well-known checkpoints, from their config.json
        (
            {
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 32,
                "vocab_size": 32000,
                "tie_word_embeddings": False,
            },
            6_738_415_616,
        ),  # Llama-2-7b
        (
            {
                "model_type": "mistral",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "vocab_size": 32000,
                "tie_word_embeddings": False,
            },
            7_241_732_096,
        ),  # Mistral-7B-v0.1
        (
            {
                "model_type": "mixtral",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "vocab_size": 32000,
                "tie_word_embeddings": False,
                "num_local_experts": 8,
            },
            46_702_792_704,
        ),  # Mixtral-8x7B
        (
            {
                "model_type": "gpt2",
                "n_embd": 768,
                "n_head": 12,
                "n_layer": 12,
                "n_positions": 1024,
                "vocab_size": 50257,
            },
            124_439_808,
        ),  # gpt2
    ],
)
def test_count_config_published_models(cfg, published, tmp_path, capsys):
    assert count_config(cfg)[0] == published
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert from_config(str(tmp_path / "config.json")).trainable == published


FACTORY = """
import torch
from torch import nn

def tied_with_frozen():
    m = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.Linear(64, 1000, bias=False))
    m[2].weight = m[0].weight
    m[1].requires_grad_(False)
    return m

def huge():
    return nn.Linear(100_000, 100_000)  # 10^10 parameters: 40 GB if it were really allocated

instance = nn.Linear(3, 5)
"""


def test_from_factory_counts_tied_once_and_frozen_apart(tmp_path, monkeypatch):
    (tmp_path / "cli_models_under_test.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "cli_models_under_test", raising=False)
    got = from_factory("cli_models_under_test:tied_with_frozen")
    assert (got.trainable, got.frozen) == (1000 * 64, 64 * 64 + 64)
    huge = from_factory("cli_models_under_test:huge")  # built on the meta device: no memory
    assert huge.trainable == 100_000 * 100_000 + 100_000
    assert from_factory("cli_models_under_test:instance").trainable == 3 * 5 + 5


def test_plan_model_and_config_sources(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_models_under_test2.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["plan", "--model", "cli_models_under_test2:tied_with_frozen", "--json", "p.json"]) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["params"] == {"trainable": 64000, "frozen": 4160, "total": 68160}
    # frozen params have a working copy but no grads or optimizer state
    assert plan["precisions"]["bf16"]["state_bytes"]["params"] == 2 * 68160
    assert plan["precisions"]["bf16"]["state_bytes"]["master"] == 4 * 64000


# -- the profile -------------------------------------------------------------------------------------
def test_profile_round_trip_and_bandwidths(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile.load_profile() is None
    data = {
        "schema": profile.SCHEMA,
        "created": "2024-01-01T00:00:00+00:00",
        "device": {"h2d_GBps": 12.5, "d2h_GBps": 13.0},
        "host": {"copy_GBps": 26.0},
        "nvme": {"write_GBps": 2.0, "read_GBps": 1.5},
        "adam": {"tiermem_Gparams_per_s": 1.25},
        "noisy": ["nvme.read_GBps"],
    }
    path = profile.save_profile(data)
    assert path == tmp_path / "xdg" / "tiermem" / "profile.json"
    p = profile.load_profile()
    assert p.data == data and p.created == data["created"] and p.noisy() == ["nvme.read_GBps"]
    assert p.bandwidth(Tier.HOST, Tier.DEVICE) == 12.5e9 and p.bandwidth(Tier.DEVICE, Tier.HOST) == 13.0e9
    assert p.bandwidth(Tier.HOST, Tier.NVME) == 2.0e9 and p.bandwidth(Tier.NVME, Tier.HOST) == 1.5e9
    assert p.bandwidth(Tier.HOST, Tier.HOST) == 26.0e9 and p.bandwidth(Tier.DEVICE, Tier.NVME) is None
    assert p.adam_params_per_second() == 1.25e9


@pytest.mark.parametrize("text", ["{half a file", "[1, 2]", '{"schema": 999}'])
def test_unreadable_profile_reads_as_none_with_a_warning(text, tmp_path, caplog):
    path = tmp_path / "profile.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="tiermem.plan.profile"):
        assert profile.load_profile(path) is None
    assert "run `tiermem bench`" in caplog.text


# -- the measurements --------------------------------------------------------------------------------
def test_rate_statistics():
    import statistics

    r = measure.Rate((1.0, 2.0, 4.0))
    assert r.median == 2.0
    assert r.cv == pytest.approx(statistics.stdev([1, 2, 4]) / statistics.fmean([1, 2, 4]))
    assert r.noisy and not measure.Rate((100.0, 101.0, 99.0)).noisy and measure.Rate((5.0,)).cv == 0.0


def test_measure_times_only_fn_and_prepares_each_call():
    calls = {"fn": 0, "prepare": 0}

    def fn():
        calls["fn"] += 1
        time.sleep(0.002)

    def prepare():
        calls["prepare"] += 1
        time.sleep(0.01)  # not timed: rates must stay near units / 2 ms, not units / 12 ms

    r = measure.measure(fn, 1000.0, repeats=3, min_seconds=0.005, prepare=prepare)
    assert calls["fn"] == calls["prepare"] and (calls["fn"] - 1) % 3 == 0
    assert len(r.samples) == 3 and all(0 < s <= 1000 / 0.002 for s in r.samples)
    assert r.median > 1000 / 0.008


@pytest.mark.parametrize("direct", [True, False])
def test_nvme_point_round_trips_through_the_store(tmp_path, direct):
    src = measure.filled(3 * MiB + 4096)
    out = measure.filled(3 * MiB + 4096)
    pt = measure.nvme_point(
        str(tmp_path), src, out, block_size=MiB, in_flight=2, direct=direct, repeats=2, min_seconds=0.0
    )
    assert torch.equal(src, out) and pt.direct == (direct and _o_direct_works(tmp_path))
    assert pt.write.median > 0 and pt.read.median > 0
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmn"]  # the store's files are gone


def test_host_copies_copy():
    a, b = measure.filled(2 * MiB + 6), measure.filled(2 * MiB + 6)
    b.zero_()
    assert measure.host_copy(a, b, repeats=2, min_seconds=0.0).median > 0 and torch.equal(a, b)
    ref_a, ref_b = a.clone(), b.clone()
    b[: a.numel() // 2].zero_()
    measure.host_copy_pair(a, b, repeats=1, min_seconds=0.0)
    assert torch.equal(a, ref_a) and torch.equal(b, ref_b)  # halves copied both ways
