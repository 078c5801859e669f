"""examples/from_deepspeed.py, the snippets of docs/deepspeed.md ("Coming from DeepSpeed"): the
example runs both migrations and the loss falls in each; every line of the page's snippets marked
as lines of the example is a line of it, so what the docs show is what runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from fresh import run_python

pytest.importorskip("transformers")  # the `hf` extra

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "from_deepspeed.py"


def test_docs_snippets_are_lines_of_the_example():
    source = {re.sub(r"\s*# noqa: E402$", "", line).strip() for line in EXAMPLE.read_text().splitlines()}
    marker = f"<!-- not run: lines of {EXAMPLE.relative_to(ROOT)}, which tests/test_integrations_examples.py runs -->"
    blocks = re.findall(
        re.escape(marker) + r"\n```python\n(.*?)```", (ROOT / "docs" / "deepspeed.md").read_text(), re.S
    )
    assert len(blocks) == 2
    for block in blocks:
        for line in block.splitlines():
            if line.strip() and line.strip() != "...":
                assert line.strip() in source, f"docs/deepspeed.md line not in {EXAMPLE.name}: {line!r}"


def test_example_runs_both_migrations(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    proc = run_python(str(EXAMPLE), "--steps", "10", "--out", str(tmp_path / "run"), timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"loss: DeepSpeed loop (\S+) -> (\S+); Trainer (\S+) -> (\S+)", proc.stdout)
    assert m, proc.stdout
    first, last, t_first, t_last = map(float, m.groups())
    assert last < first - 0.5 and t_last < t_first - 0.3, proc.stdout  # both learn (bytes: ln 256 ~ 5.5 at start)
    # the keys of the config tiermem does not honour, one line each
    assert proc.stderr.count("zero_optimization.overlap_comm=true not honoured") == 2, proc.stderr
    assert "policy=ZeroOffload()" in proc.stdout and "checkpoint-10" in proc.stdout
    assert (tmp_path / "run" / "checkpoint-10" / "tiermem.ckpt").is_file()
