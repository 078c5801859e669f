"""The package's sizes, beside its layering (tests/test_layering.py): a function a reader takes in
at once, a module with one concern, a folder that names its parts. Read from the source with
``ast``, so a function or module that outgrows them fails here, with its name and size.

- no function over 60 lines (its docstring aside), no module over 500 lines;
- no folder with more than 15 modules, at most 8 modules at the package's top level;
- no module name in two folders (a name says which module it is);
- at most 12 pairs of files (or a file with itself) repeating a run of 6 or more lines.
"""

from __future__ import annotations

import ast
import collections
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tiermem"
SOURCES = sorted(PACKAGE.rglob("*.py"))

MAX_FUNCTION, MAX_MODULE, MAX_FOLDER, MAX_TOP, MAX_REPEATED = 60, 500, 15, 8, 12
RUN = 6  # lines that make a repeat
TOO_COMMON = 8  # a run standing in more places than this is an idiom, not a copy


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE.parent) else str(path)


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """Each function's lines from its ``def`` to its end, its docstring's lines left out."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0]
            doc = 0
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc = (first.end_lineno or first.lineno) - first.lineno + 1
            out.append(
                (f"{_rel(path)}:{node.lineno} {node.name}", (node.end_lineno or node.lineno) - node.lineno + 1 - doc)
            )
    return out


def test_no_function_over_60_lines():
    long = [(where, n) for path in SOURCES for where, n in function_lengths(path) if n > MAX_FUNCTION]
    assert long == [], f"functions over {MAX_FUNCTION} lines (split them along what they do): {long}"


def test_no_module_over_500_lines():
    big = [(_rel(p), n) for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_MODULE]
    assert big == [], f"modules over {MAX_MODULE} lines (cut them along a seam): {big}"


def _modules_in(folder: Path) -> list[str]:
    return [p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]


def test_folders_name_their_parts():
    folders = sorted({p.parent for p in SOURCES})
    crowded = [(_rel(f), n) for f in folders if (n := len(_modules_in(f))) > MAX_FOLDER]
    assert crowded == [], f"folders over {MAX_FOLDER} modules (give a concern its own folder): {crowded}"
    top = [p.stem for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= MAX_TOP, f"{len(top)} modules at tiermem/'s top level (at most {MAX_TOP}): {sorted(top)}"


def test_no_module_name_in_two_folders():
    where = collections.defaultdict(list)
    for p in SOURCES:
        if p.name not in ("__init__.py", "__main__.py"):
            where[p.stem].append(_rel(p.parent))
    twice = {name: dirs for name, dirs in where.items() if len(dirs) > 1}
    assert twice == {}, f"module names used in two folders (name each for what it holds): {twice}"


def _significant(path: Path) -> list[str]:
    """The lines that count for a repeat: white space folded; blank lines, comments, lone
    punctuation and imports passed over."""
    out = []
    for line in path.read_text().splitlines():
        s = " ".join(line.split())
        if not s or s.startswith(("#", "import ", "from ")) or all(c in "()[]{},:" for c in s):
            continue
        out.append(s)
    return out


def repeated_pairs(sources: list[Path]) -> set[tuple[str, str]]:
    """The pairs of files (a file with itself included) that share a run of RUN significant lines."""
    seen: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for path in sources:
        lines = _significant(path)
        for i in range(len(lines) - RUN + 1):
            digest = hashlib.blake2b("\n".join(lines[i : i + RUN]).encode(), digest_size=12).hexdigest()
            seen[digest].append((_rel(path), i))
    pairs = set()
    for places in seen.values():
        if 2 <= len(places) <= TOO_COMMON:
            for a in range(len(places)):
                for b in range(a + 1, len(places)):
                    (fa, ia), (fb, ib) = places[a], places[b]
                    if fa != fb or abs(ia - ib) >= RUN:  # a run overlapping itself is one place
                        pairs.add((min(fa, fb), max(fa, fb)))
    return pairs


def test_few_repeated_runs():
    pairs = repeated_pairs(SOURCES)
    assert len(pairs) <= MAX_REPEATED, (
        f"{len(pairs)} pairs of files repeat a run of {RUN} lines (at most {MAX_REPEATED}); make one "
        f"piece serve both: {sorted(pairs)}"
    )


def test_the_size_checks_see_a_violation(tmp_path):
    """The checkers themselves: a long function, a repeated run, and an overlap that is no repeat."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION + 1))
    long = tmp_path / "long.py"
    long.write_text(f'def f():\n    """doc"""\n{body}\n')
    assert [n for _, n in function_lengths(long)] == [MAX_FUNCTION + 2]  # the def line counts
    run = "\n".join(f"    y{i} = call(a, b, {i})" for i in range(RUN))
    twice = tmp_path / "twice.py"
    twice.write_text(f"def g():\n{run}\n\n\ndef h():\n    # another\n{run}\n")
    assert repeated_pairs([twice, long]) == {(str(twice), str(twice))}
    same = tmp_path / "same.py"
    same.write_text("\n".join(["z = 1"] * (RUN + 2)) + "\n")  # windows overlapping one run
    assert repeated_pairs([same]) == set()
