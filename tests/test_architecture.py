"""Stages import only downward (docs/architecture.md): every import of a portlayer module, at
module level or inside a function, goes from a stage to itself, to a lower stage, or to the leaf
modules every stage may use (portlayer.errors, portlayer.config)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: lowest first; a stage may import the stages before it
ORDER = ["flatten", "capabilities", "codegen", "backends", "passes", "runtime", "portlayer"]
LEAVES = {"portlayer.errors", "portlayer.config"}
ROOT_NAMES = {"portlayer.__version__"}  # the package root's version string (portlayer/__init__.py is import-light)


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module == "portlayer"]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _stage_of_module(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "portlayer" or len(parts) < 2:
        return None
    if ".".join(parts[:2]) in LEAVES | ROOT_NAMES:
        return None
    return parts[1] if parts[1] in ORDER else "portlayer"


def test_stages_import_only_downward():
    bad = []
    for stage in ORDER:
        for path in sorted((ROOT / stage).rglob("*.py")):
            if path.name == "__init__.py" and stage == "portlayer":
                continue
            for line, mod in _imports(path):
                target = _stage_of_module(mod)
                if target is None or target == stage:
                    continue
                if ORDER.index(target) > ORDER.index(stage):
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({stage}) imports {mod} ({target}, a later stage)")
    assert not bad, "imports against the stage order of docs/architecture.md:\n" + "\n".join(bad)


def test_leaf_modules_import_nothing_from_portlayer():
    for leaf in LEAVES:
        path = ROOT / (leaf.replace("portlayer.", "portlayer/") + ".py")
        assert [m for _, m in _imports(path) if m.startswith("portlayer")] == [], leaf


def test_architecture_doc_lists_the_order():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = text[text.index("```"):text.index("```", text.index("```") + 3)]
    positions = [picture.index(f"\n  {s}/ ") for s in ORDER]
    assert positions == sorted(positions), "docs/architecture.md must list the stages in ORDER"
