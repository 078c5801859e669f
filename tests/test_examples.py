"""The examples: the GPT model definition, and examples/train_gpt.py run end to end as a user would."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fresh import run_python  # noqa: E402

from examples.gpt import GPT, CharTokenizer, GPTConfig, generate, lm_loss, load_corpus  # noqa: E402
from tiermem.config.specs import resolve_precision  # noqa: E402

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\d+\.\d+)", re.MULTILINE)


def run_train_gpt(*extra: str, timeout: float = 120) -> str:
    cmd = [
        str(ROOT / "examples" / "train_gpt.py"),
        "--preset",
        "tiny",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--warmup",
        "5",
        "--log-every",
        "5",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "20",
        *extra,
    ]
    proc = run_python(*cmd, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"train_gpt.py exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_train_gpt_loss_falls() -> None:
    """The example with its defaults (ZeRO-Offload, precision auto: this CPU's fast one), tiny, with
    gradient accumulation."""
    out = run_train_gpt("--steps", "30", "--grad-accum", "2")
    assert f"precision={resolve_precision('auto', torch.device('cpu'))!r}" in out, out
    steps = [(int(s), int(n), float(loss)) for s, n, loss in STEP_LINE.findall(out)]
    assert [s for s, _, _ in steps] == list(range(5, 31, 5)) and steps[0][1] == 30, out
    first, last = steps[0][2], steps[-1][2]
    # A char-level model starts near ln(vocab) ~ 4.4 and learns letter frequencies within tens of steps.
    assert last < first - 0.3, f"loss did not fall: {first} -> {last}\n{out}"
    assert "held-out loss" in out and "---- sample ----" in out and "tiermem report" in out, out


def test_train_gpt_other_options_write_checkpoint_and_trace(tmp_path: Path) -> None:
    # fp16 matmuls are slow on CPUs (no native kernels), so this run is short: it checks that
    # the other policy, fp16, --save and --trace work, not that the model learns.
    ckpt, trace = tmp_path / "gpt.ckpt", tmp_path / "gpt.trace.json"
    out = run_train_gpt(
        "--policy",
        "keep-on-device",
        "--precision",
        "fp16",
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--save",
        str(ckpt),
        "--trace",
        str(trace),
    )
    assert "policy=KeepOnDevice()" in out and "precision='fp16'" in out, out
    assert ckpt.exists() and f"checkpoint written to {ckpt}" in out, out
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("name") == "forward" for e in events), events[:5]


def test_train_gpt_with_weights_and_state_on_nvme(tmp_path: Path) -> None:
    out = run_train_gpt("--policy", "zero-infinity", "--nvme-dir", str(tmp_path), "--steps", "10")
    assert "policy=ZeroInfinity()" in out and "nvme->device" in out, out
    steps = [float(loss) for _, _, loss in STEP_LINE.findall(out)]
    assert steps[-1] < steps[0], out


def test_gpt_head_is_tied_to_embedding() -> None:
    model = GPT(GPTConfig.preset("tiny", vocab_size=50))
    assert model.head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))
    assert model.num_params() < 1_000_000
    assert set(model.state_dict()) >= {"wte.weight", "head.weight"}


def test_gpt_is_causal() -> None:
    """Changing the last token leaves every earlier position's logits as they were."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=50)).eval()
    x = torch.randint(50, (2, 17))
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % 50
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_lm_loss_is_fp32_cross_entropy() -> None:
    torch.manual_seed(0)
    logits, y = torch.randn(2, 5, 7).bfloat16(), torch.randint(7, (2, 5))
    loss = lm_loss(logits, y)
    assert loss.dtype == torch.float32
    expected = -torch.log_softmax(logits.float(), -1).gather(-1, y.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss, expected)


def test_tokenizer_round_trip_and_generate() -> None:
    text = load_corpus()
    tok = CharTokenizer(text)
    assert tok.decode(tok.encode(text[:500])) == text[:500]
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size, block_size=8)).eval()
    out = generate(model, tok.encode("Lic").view(1, -1), 12, block_size=8, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 15) and out.max() < tok.vocab_size


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_embd": 65, "n_head": 2}, "not a multiple of n_head"),
        ({"n_layer": 0}, r"n_layer=0: must be >= 1"),
        ({"dropout": 1.0}, r"dropout=1.0: must be in \[0, 1\)"),
    ],
)
def test_gpt_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig.preset("tiny", **kwargs)


def test_gpt_rejects_too_long_input_and_unknown_preset() -> None:
    model = GPT(GPTConfig.preset("tiny", vocab_size=10, block_size=4))
    with pytest.raises(ValueError, match="longer than block_size=4"):
        model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        CharTokenizer("abc").encode("abd")


def test_lora_example_trains_with_its_base_weights_on_nvme(tmp_path: Path) -> None:
    """examples/lora.py, a few steps: LoRA adapters trained with the base on NVMe, then merged."""
    pytest.importorskip("peft")
    cmd = [
        str(ROOT / "examples" / "lora.py"),
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--nvme-dir",
        str(tmp_path),
    ]
    proc = run_python(*cmd, timeout=180, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, f"lora.py exited {proc.returncode}\n{out}\n{proc.stderr}"
    losses = [float(x) for x in re.findall(r"^step\s+\d+  loss (\d+\.\d+)", out, re.MULTILINE)]
    assert len(losses) >= 2 and all(x == x for x in losses) and "(skipped)" not in out, out
    assert "nvme->device" in out and "sample:" in out, out


def test_finetune_trains_with_one_group_per_layer_and_unfreezes_them_in_turn() -> None:
    """examples/finetune.py: LLRD groups from a torch optimizer, each layer unfrozen in turn."""
    cmd = [
        str(ROOT / "examples" / "finetune.py"),
        "--pretrain-steps",
        "3",
        "--steps",
        "12",
        "--unfreeze-every",
        "3",
        "--precision",
        "fp32",
    ]
    proc = run_python(*cmd, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, f"finetune.py exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "groups: layer0 lr 1.03e-03, layer1 lr 1.47e-03, layer2 lr 2.10e-03, layer3 lr 3.00e-03" in proc.stdout
    # layer 3 from the start, then one layer down every 3 steps: from steps 3, 6 and 9 of 12
    assert "updates per layer: layer0 4, layer1 7, layer2 10, layer3 12" in proc.stdout, proc.stdout
