"""examples/custom_policy.py and examples/nvme_offload.py, run as a user would (tiny model, few steps)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fresh import run_python  # noqa: E402

from examples import nvme_offload  # noqa: E402
from tiermem import parse_bytes  # noqa: E402

SMALL = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32"]
ROW = re.compile(
    r"^(param|grad|optim_state|activation)\s+(device|host|nvme)\s+(-|[\d.]+ \w?i?B)\s+([\d.]+ \w?i?B)", re.MULTILINE
)


def run_example(name: str, *args: str, cwd: Path) -> str:
    proc = run_python(str(ROOT / "examples" / name), *args, timeout=120, cwd=cwd)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_custom_policy_is_honoured_and_matches_zero_offload(tmp_path: Path) -> None:
    out = run_example("custom_policy.py", *SMALL, "--steps", "3", cwd=tmp_path)
    assert "placements honoured" in out and "NOT" not in out, out
    assert "losses bit-identical, weights bit-identical" in out, out
    rows = {(c, t): (asked, peak) for c, t, asked, peak in ROW.findall(out)}
    asked, peak = rows[("optim_state", "nvme")]  # the embeddings' state, and its next value written beside it
    assert parse_bytes(peak) == 2 * parse_bytes(asked), out
    assert parse_bytes(rows[("param", "host")][0]) > 0 and ("optim_state", "device") not in rows, out
    assert list(tmp_path.iterdir()) == [], "the temporary NVMe directory was left behind"


def test_nvme_offload_refuses_zero_offload_and_trains_zero_infinity(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = run_example(
        "nvme_offload.py",
        *SMALL,
        "--policy",
        "zero-infinity",
        "--steps",
        "8",
        "--log-every",
        "2",
        "--nvme-dir",
        str(nvme),
        cwd=tmp_path,
    )
    assert re.search(
        r"ZeroOffload\(\) is refused.*\n  tiermem: out of host memory .*optimizer state "
        r"[\d.]+ \w?i?B.*raise Budgets\(host=\.\.\.\)",
        out,
    ), out
    losses = [float(x) for x in re.findall(r"^step +\d+/8 \| loss (\d+\.\d+)", out, re.MULTILINE)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, out
    m = re.search(r"host budget ([\d.]+ \w?i?B)", out)
    budget = parse_bytes(m.group(1))
    host_peak = parse_bytes(re.search(r"^host +([\d.]+ \w?i?B)", out, re.MULTILINE).group(1))
    state = parse_bytes(re.search(r"optimizer state 12 B/param = ([\d.]+ \w?i?B)", out).group(1))
    assert host_peak <= budget < state, out
    assert "tiermem report: 8 steps" in out and re.search(r"^nvme->device", out, re.MULTILINE), out
    assert list(nvme.iterdir()) == [], "the model's files were left in --nvme-dir"


def test_nvme_offload_default_policy_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert nvme_offload.main([*SMALL, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "policy=OptimStateOnNvme()" in out and "ZeroOffload() is refused" in out, out
    assert "param" not in re.search(r"^nvme .*$", out, re.MULTILINE).group(0), out  # only the state went to NVMe
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "budget, status, match",
    [
        ("2MiB", 2, r"--host-budget 2.00 MiB holds the whole optimizer state \(1\.23 MiB\)"),  # 107,328 params x 12 B
        (
            "600KiB",
            1,
            r"OptimStateOnNvme\(\) does not fit either:\n  tiermem: out of host memory .* raise "
            r"Budgets\(host=\.\.\.\) to at least",
        ),
    ],
)
def test_nvme_offload_budget_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    budget: str,
    status: int,
    match: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert nvme_offload.main([*SMALL, "--steps", "1", "--host-budget", budget]) == status
    assert re.search(match, capsys.readouterr().err), budget
    assert list(tmp_path.iterdir()) == []
