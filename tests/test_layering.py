"""The package's layers: imports flow one way (vocabulary -> config -> policy/optim -> plan ->
memory -> observe -> transfer -> train/checkpoint -> model -> integrations -> cli) and the
module-level import graph has no cycle. Read from the source with ``ast``, so a new import that
breaks the layering fails here, not in a user's process."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: layer of each module, by longest matching prefix
LAYERS = {
    "tiermem.types": 0,  # the vocabulary
    "tiermem.errors": 0,
    "tiermem.handles": 0,
    "tiermem.spans": 0,
    "tiermem.config": 1,  # optimizer specs, rules, precisions, budgets
    "tiermem.plan.policy": 2,
    "tiermem.policies": 2,
    "tiermem.optim": 2,
    "tiermem.plan": 3,
    "tiermem.memory": 4,
    "tiermem.observe": 5,
    "tiermem.transfer": 6,
    "tiermem.train": 7,  # homes, weights, the step
    "tiermem.checkpoint": 7,  # beside train: a checkpoint reads and writes the homes; materializing reads weight files
    "tiermem.model": 8,  # TieredModel and its construction: the composition root
    "tiermem.integrations": 9,
    "tiermem.cli": 10,
    "tiermem.__main__": 10,
    "tiermem": 10,  # the package itself re-exports the public API
}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def sources() -> dict[str, Path]:
    out = {}
    for base, prefix in ((REPO / "tiermem", "tiermem"),):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def imports(path: Path, known: set[str], *, top_level_only: bool) -> set[str]:
    """The tiermem modules ``path`` imports (``from pkg import submodule`` counts as the submodule)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tiermem"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tiermem")}
    return found


MODULES = sources()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_never_reach_a_higher_layer(module):
    mine = layer(module)
    for target in imports(MODULES[module], set(MODULES), top_level_only=False):
        assert layer(target) <= mine, (
            f"{module} (layer {mine}) imports {target} (layer {layer(target)}): "
            f"move the shared code down a layer or pass it in"
        )


def test_no_import_cycle_at_module_level():
    graph = {m: imports(p, set(MODULES), top_level_only=True) & set(MODULES) for m, p in MODULES.items()}
    for m in graph:  # a package's own __init__ importing its submodules is not a cycle
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_layering_test_sees_a_violation():
    """The checker itself: an upward import is reported."""
    assert layer("tiermem.memory.nvme") > layer("tiermem.plan.placement")
    assert layer("tiermem.model.tiered_model") > layer("tiermem.transfer.engine") > layer("tiermem.memory.resident")
    assert "tiermem.train.homes.bucket_homes" in imports(
        MODULES["tiermem.train.layout"], set(MODULES), top_level_only=True
    )


def test_the_device_caches_reclaimer_is_an_import_the_layering_sees():
    """NOTE [Reclaimers at construction]: a ledger calls up into the caches on its tier through the
    Reclaimer protocol they import from it, never through an import of its own, so the call from
    memory/ up into transfer/ is an edge this test reads (transfer.schedule -> memory.ledger)."""
    known = set(MODULES)
    assert "tiermem.memory.ledger" in imports(MODULES["tiermem.transfer.schedule"], known, top_level_only=True)
    assert not any(
        layer(t) > layer("tiermem.memory.ledger")
        for t in imports(MODULES["tiermem.memory.ledger"], known, top_level_only=False)
    )


@pytest.mark.parametrize(
    "module, names",
    [
        ("tiermem.model.tiered_model", ["TieredModel", "StepResult", "Phase"]),
        (
            "tiermem.integrations.deepspeed.walk",
            ["from_deepspeed_config", "translate", "read_config", "OffloadPolicy", "CONFIG_KEYWORDS", "PASS_THROUGH"],
        ),
        ("tiermem.transfer.schedule", ["ResidencyScheduler", "ScheduleStats", "AccessTrace", "choose_victim"]),
        ("tiermem.transfer.schedule", ["lookahead_window", "EVICTION_POLICIES"]),
    ],
)
def test_a_module_split_keeps_the_names_others_import_from_it(module, names):
    """A module cut along a seam keeps every name code outside it imports from it (tests, docs,
    users: DESIGN.md's public API), re-exported from the new home where it moved."""
    found = importlib.import_module(module)
    assert [n for n in names if not hasattr(found, n)] == []
