"""The docs match the code (issue 23): every code block in README.md and docs/ runs, the NOTE index
in docs/architecture.md is the one the code defines, and every public class and function documents
each of its arguments.

Code blocks. A fenced ``python`` block runs in a fresh namespace holding what the docs say the
snippets assume (:func:`_prelude`: ``model``, a tiny GPT; ``loss_fn``; ``data``, two ``(x, y)``
batches; ``x``, ``y``), in a scratch directory that has an empty ``nvme/`` directory. A block right
after ``<!-- run: continues the block above -->`` runs in the namespace the block before it left.
A ``bash`` block runs when every command in it is a ``tiermem`` command (in this process, through
``tiermem.cli.main``, which must return 0). Any other python or bash block carries
``<!-- not run: <why> -->`` on the line before it; the reason must say something.

``python tests/test_docs.py`` rewrites the NOTE index of docs/architecture.md from the code.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python", "bash", "text", "json"}  # text/json: output and file contents, never run
CONTINUES = "<!-- run: continues the block above -->"
NOT_RUN = re.compile(r"^<!-- not run: (.*) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: Optional[str]  # the HTML comment on the line before the fence, if any

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def skipped_because(self) -> Optional[str]:
        m = NOT_RUN.match(self.marker or "")
        return m.group(1).strip() if m else None


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), None)
        marker = prev if prev and prev.startswith("<!--") else None
        out.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker))
        i += 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]


def _cli_commands(block: Block) -> Optional[list[list[str]]]:
    """The block's commands when every one is a ``tiermem`` command, else None."""
    commands = []
    for line in block.code.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line:
            continue
        argv = shlex.split(line)
        if argv[0] != "tiermem":
            return None
        commands.append(argv[1:])
    return commands


def _chains() -> list[list[Block]]:
    """The python blocks to run, each with the blocks that continue it."""
    chains: list[list[Block]] = []
    for b in ALL:
        if b.lang != "python" or b.skipped_because is not None:
            continue
        if b.marker == CONTINUES:
            assert chains and chains[-1][-1].path == b.path, f"{b.where} continues no block above it"
            chains[-1].append(b)
        else:
            chains.append([b])
    return chains


# -- every block is accounted for -----------------------------------------------------------------------
def test_every_block_runs_or_says_why_not():
    problems = []
    for b in ALL:
        if b.lang not in LANGUAGES:
            problems.append(f"{b.where}: fence language {b.lang!r}; use one of {sorted(LANGUAGES)}")
        reason = b.skipped_because
        if b.marker and b.marker.startswith("<!-- not run") and not reason:
            problems.append(f"{b.where}: '<!-- not run: ... -->' must say why")
        if b.lang == "bash" and reason is None and _cli_commands(b) is None:
            problems.append(
                f"{b.where}: a shell block that is not all `tiermem` commands needs "
                f"'<!-- not run: <why> -->' on the line before it"
            )
        if b.lang in ("text", "json") and b.marker is not None:
            problems.append(f"{b.where}: a {b.lang} block is never run; drop the marker")
    assert not problems, "\n".join(problems)


def test_the_docs_have_code_to_run():
    """The checks below cannot pass by finding nothing: the README's loop and the pages' blocks."""
    assert sum(len(c) for c in _chains()) >= 20
    assert any(b.path.name == "README.md" for c in _chains() for b in c)


# -- python blocks -----------------------------------------------------------------------------------
def _prelude() -> dict:
    """What the docs say every snippet may assume (docs/concepts.md, "The three calls")."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.gpt import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32))
    data = []
    for _ in range(2):
        ids = torch.randint(0, 37, (2, 9))
        data.append((ids[:, :-1], ids[:, 1:]))
    x, y = data[0]
    return {"__name__": "__docs__", "torch": torch, "model": model, "loss_fn": lm_loss, "data": data, "x": x, "y": y}


@pytest.mark.parametrize("chain", _chains(), ids=lambda c: c[0].where)
def test_python_block_runs(chain, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme").mkdir()
    namespace = _prelude()
    for b in chain:
        try:
            exec(compile(b.code, b.where, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the code block at {b.where} failed: {type(e).__name__}: {e}") from e
    from tiermem import Phase, TieredModel

    for value in list(namespace.values()):  # give back what the snippet built (threads, files, locks)
        if isinstance(value, TieredModel) and value.phase is not Phase.DETACHED:
            value.detach()


# -- shell blocks of tiermem commands ------------------------------------------------------------------
CLI = [b for b in ALL if b.lang == "bash" and b.skipped_because is None and _cli_commands(b)]


@pytest.mark.parametrize("block", CLI, ids=lambda b: b.where)
def test_cli_block_runs(block, tmp_path, monkeypatch):
    from tiermem.cli import main

    monkeypatch.chdir(tmp_path)
    for argv in _cli_commands(block):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(argv)
        assert rc == 0, f"{block.where}: `tiermem {shlex.join(argv)}` exited {rc}:\n{out.getvalue()[-2000:]}"


# -- the README ----------------------------------------------------------------------------------------
def test_readme_reads_in_five_minutes_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs the test command the README gives a newcomer."""
    command = "python -m pytest -q -n auto"
    assert f"pip install -e '.[test]' && {command}" in (ROOT / "README.md").read_text()
    assert any(line.strip() == command for line in (ROOT / ".ci" / "run").read_text().splitlines())


# -- the layers table -------------------------------------------------------------------------------
def test_architecture_page_gives_each_module_its_layer():
    """docs/architecture.md's table puts every prefix of tests/test_layering.py's LAYERS in the row
    of its layer, so the table moves when the layering does."""
    from test_layering import LAYERS

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows: dict[int, str] = {}
    for line in text.splitlines():
        m = re.match(r"^\| (\d+) \|(.*)", line)
        if m:
            rows[int(m.group(1))] = rows.get(int(m.group(1)), "") + m.group(2)
    for module, layer in LAYERS.items():
        if module in ("tiermem", "tiermem.__main__"):
            continue  # the package's own re-exports
        rel = module.replace(".", "/")
        names = (f"`{rel}/`", f"`{rel}.py`", f"`{module.rsplit('.', 1)[1]}`")
        assert any(n in rows.get(layer, "") for n in names), f"{module} is not in the row of layer {layer}"


# -- the NOTE index ----------------------------------------------------------------------------------
NOTE_DEF = re.compile(r"^\s*(?:#|//)?\s*NOTE \[([^\]]+)\]\s*$")
NOTE_REF = re.compile(r"NOTE \[([^\]]+)\]")
BEGIN, END = "<!-- notes:begin (python tests/test_docs.py writes this table) -->", "<!-- notes:end -->"


def _sources() -> list[Path]:
    return sorted(p for d in ("tiermem",) for p in (ROOT / d).rglob("*.py"))


def note_definitions() -> dict[str, list[str]]:
    """Title -> the files whose line holds ``NOTE [Title]`` alone (``#`` or ``//`` comment, or a
    docstring line): where each NOTE block starts."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        for line in path.read_text().splitlines():
            m = NOTE_DEF.match(line)
            if m:
                rel = str(path.relative_to(ROOT))
                if rel not in found.setdefault(m.group(1), []):
                    found[m.group(1)].append(rel)
    return found


def note_index() -> str:
    rows = ["| NOTE | where |", "|---|---|"]
    for title, files in sorted(note_definitions().items(), key=lambda kv: kv[0].lower()):
        rows.append(f"| {title} | {', '.join(f'`{f}`' for f in files)} |")
    return "\n".join([BEGIN, *rows, END])


def _index_in_docs() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def test_architecture_page_indexes_every_note_block():
    assert _index_in_docs() == note_index(), "docs/architecture.md's NOTE index is stale: run python tests/test_docs.py"


def test_every_note_named_is_defined():
    defined = note_definitions()
    assert len(defined) >= 50  # the index cannot pass by finding nothing
    # a reference may wrap: "NOTE [Adam\n    # hyperparameter rules]" names "Adam hyperparameter rules"
    texts = [re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", p.read_text()) for p in [*_sources(), *DOCS]]
    named = {t for text in texts for t in NOTE_REF.findall(text) if t != "..."}
    assert sorted(named - set(defined)) == []


# -- docstrings ----------------------------------------------------------------------------------------
def _documented_names(doc: Optional[str]) -> set[str]:
    """The names listed under the Google-style sections Args:, Attributes: of ``doc``."""
    names = set()
    for m in re.finditer(r"^\s*(?:Args|Attributes):\s*\n((?:[ \t]+\S.*\n?|[ \t]*\n)*)", doc or "", re.M):
        for line in m.group(1).splitlines():
            item = re.match(r"^\s+\*{0,2}([A-Za-z_]\w*)(?: \([^)]*\))?:", line)
            if item:
                names.add(item.group(1))
    return names


def _arguments(fn, method: bool) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
    return params[1:] if method and params and params[0] in ("self", "cls") else params


def _public_api() -> list[tuple[str, object]]:
    import tiermem
    import tiermem.optim
    import tiermem.policies
    from tiermem.integrations.transformers import TieredTrainer

    out = [
        (f"{m.__name__}.{n}", getattr(m, n))
        for m in (tiermem, tiermem.policies, tiermem.optim)
        for n in m.__all__
        if not n.startswith("__")
    ]
    return out + [("tiermem.integrations.transformers.TieredTrainer", TieredTrainer)]


def _undocumented(qual: str, obj) -> list[str]:
    if not inspect.isclass(obj):
        if not obj.__doc__:
            return [f"{qual}: no docstring"]
        missing = [a for a in _arguments(obj, False) if a not in _documented_names(inspect.getdoc(obj))]
        return [f"{qual}: arguments {missing} not under Args:"] if missing else []
    problems = [] if obj.__doc__ else [f"{qual}: no docstring"]
    if issubclass(obj, enum.Enum):
        return problems
    init = obj.__dict__.get("__init__")  # its own (a dataclass's too); an inherited one is documented there
    if init is not None and getattr(init, "__wrapped__", None) is not object.__init__:
        doc = (inspect.getdoc(obj) or "") + "\n" + (inspect.getdoc(init) or "")
        missing = [a for a in _arguments(getattr(init, "__wrapped__", init), True) if a not in _documented_names(doc)]
        if missing:
            problems.append(f"{qual}: constructor arguments {missing} not under Args:")
    for name, member in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            problems += [] if member.fget.__doc__ else [f"{qual}.{name}: no docstring"]
            continue
        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if not inspect.isfunction(fn):
            continue
        doc = inspect.getdoc(getattr(obj, name))  # an override may inherit its base's
        if not doc:
            problems.append(f"{qual}.{name}: no docstring")
            continue
        missing = [a for a in _arguments(fn, not isinstance(member, staticmethod)) if a not in _documented_names(doc)]
        if missing:
            problems.append(f"{qual}.{name}: arguments {missing} not under Args:")
    return problems


def test_every_public_class_and_function_documents_its_arguments():
    api = _public_api()
    assert len(api) >= 40
    problems = [p for qual, obj in api for p in _undocumented(qual, obj)]
    assert not problems, "\n".join(problems)


def test_the_docstring_check_finds_what_is_missing():
    """The check above can fail: a function with an argument its docstring leaves out is caught."""

    def half(x, y):
        """Half of a sum.

        Args:
            x: documented.
        """

    assert _undocumented("half", half) == ["half: arguments ['y'] not under Args:"]


if __name__ == "__main__":
    page = ROOT / "docs" / "architecture.md"
    text = page.read_text()
    page.write_text(text[: text.index(BEGIN)] + note_index() + text[text.index(END) + len(END) :])
    print(f"wrote the NOTE index of {page.relative_to(ROOT)} ({len(note_definitions())} NOTEs)")


def test_every_bench_script_has_a_row_in_the_index():
    """bench/README.md's index names every script in bench/ (what it measures, its anchor, the
    command), so a new benchmark cannot be left out of it."""
    index = (ROOT / "bench" / "README.md").read_text()
    rows = set(re.findall(r"^\| `([\w.]+\.py)` \|", index, flags=re.M))
    scripts = {p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_")}
    assert scripts - rows == set(), f"bench scripts without a row in bench/README.md: {sorted(scripts - rows)}"
    assert rows - scripts == set(), f"rows of bench/README.md naming no script: {sorted(rows - scripts)}"
