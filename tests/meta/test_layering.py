"""The package's floors: every import points down the data flow, and there is no circle.

edgerun's units (a subpackage, or a top-level module) sit on FLOORS, lowest first. A
module may import its own unit and any unit on a lower floor, never one on its own floor
or above: not at module level, not inside a function, not under TYPE_CHECKING, not
through `importlib.import_module("...")` with a constant name. The package root
(edgerun/__init__.py, the lazy public names) is exempt. With no import sideways or up
between units, a circle can only sit inside one unit; test_no_circle looks there too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "edgerun"

# lowest first; a unit imports only its own unit and units on lower floors
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version"),
    ("runtime", "corpus"),
    ("quant", "arch"),
    ("tokenizer",),
    ("formats",),
    ("ops",),
    ("model",),
    ("generate",),
    ("registry",),
    ("gpu", "offload"),
    ("device",),
    ("serving",),
    ("api",),
    ("serve", "tui", "tools"),
    ("cli",),
    ("__main__",),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def module_name(path: Path, root: Path) -> tuple[str, str]:
    """(module, package) of a .py file under root (root is the edgerun package)."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def imports_of(path: Path, root: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, source text) for every import in the file.

    `from a import b` yields both a and a.b (b may be a submodule)."""
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src, str(path))
    _, package = module_name(path, root)
    lines = src.splitlines()
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
            continue
        text = lines[node.lineno - 1].strip()
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, text) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod, text))
            out.extend((node.lineno, f"{mod}.{a.name}", text) for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("import_module", "__import__")
                )
            )
        ):
            out.append((node.lineno, node.args[0].value, text))
    return out


def unit_of(rel: str) -> str:
    """The unit of a path relative to edgerun/ ('model/layer.py' -> 'model')."""
    first = rel.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


def violations(root: Path = PKG) -> list[str]:
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "__init__.py":
            continue
        unit = unit_of(rel)
        if unit not in FLOOR:
            bad.append(f"edgerun/{rel}: unit '{unit}' has no floor in FLOORS")
            continue
        seen: set[tuple[int, str]] = set()
        for line, mod, text in imports_of(path, root):
            parts = mod.split(".")
            if parts[0] != "edgerun" or len(parts) < 2:
                continue
            target = parts[1]
            if target == unit or (line, target) in seen:
                continue
            if target not in FLOOR:
                if (root / target).is_dir() or (root / f"{target}.py").exists():
                    seen.add((line, target))
                    bad.append(f"edgerun/{rel}:{line}: {text!r} -> unit '{target}' has no floor")
                continue  # a name from a package (from edgerun.x import y)
            if FLOOR[target] >= FLOOR[unit]:
                seen.add((line, target))
                where = "its own floor" if FLOOR[target] == FLOOR[unit] else "a higher floor"
                bad.append(
                    f"edgerun/{rel}:{line}: {text!r} -> {mod} ({unit} must not import "
                    f"edgerun.{target}, on {where})"
                )
    return bad


def test_layers_import_only_downwards():
    bad = violations()
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_every_unit_has_a_floor():
    units = {unit_of(p.relative_to(PKG).as_posix()) for p in PKG.rglob("*.py")} - {"__init__"}
    assert units <= set(FLOOR), sorted(units - set(FLOOR))


def _module_graph(root: Path) -> dict[str, set[str]]:
    mods = {module_name(p, root)[0]: p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for _, target, _ in imports_of(p, root):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            # importing a submodule runs its package's __init__: not an edge back to it
            if target and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def circles(root: Path = PKG) -> list[list[str]]:
    """Strongly connected groups of modules (more than one) in the import graph."""
    graph = _module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_circle():
    found = circles()
    assert not found, f"import circles: {found}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "edgerun"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in {p.parent for p in root.rglob("*.py")} | {root}:
        (d / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("rel", "text", "expect"),
    [
        ("quant/x.py", "from edgerun.ops import qmatvec\n", "quant/x.py:1"),
        ("quant/x.py", "def f():\n    from edgerun.model import transformer\n", "quant/x.py:2"),
        ("quant/x.py", "from ..ops.qmatvec import matvec\n", "edgerun.ops"),
        ("quant/x.py", "from .. import arch\n", "own floor"),
        ("formats/x.py", "def f():\n    import edgerun.model.weights\n", "formats/x.py:2"),
        ("formats/x.py", "import importlib\nimportlib.import_module('edgerun.api')\n", ":2"),
        ("ops/x.py", "from edgerun.model.transformer import T\n", "edgerun.model"),
        ("ops/x.py", "from edgerun.model.kvcache import KVCache\n", "edgerun.model.kvcache"),
        ("model/x.py", "from edgerun.tools.calibrate import f\n", "edgerun.tools"),
        (
            "serving/x.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from edgerun.api import Model\n",
            "serving/x.py:3",
        ),  # fmt: skip
        ("gpu/x.py", "from edgerun.offload import store\n", "own floor"),
        ("newpkg.py", "import os\n", "no floor"),
    ],
)
def test_checker_catches_a_bad_import(tmp_path, rel, text, expect):
    bad = violations(_tree(tmp_path, {rel: text}))
    assert len(bad) == 1 and expect in bad[0], bad


def test_checker_allows_the_permitted_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "quant/x.py": "from .formats import Q\nfrom edgerun import errors\n",
            "formats/x.py": (
                "def f():\n    from edgerun.tokenizer import T\n    from .. import arch\n"
            ),
            "ops/x.py": "from edgerun.quant.reference import dequantize\nfrom . import _simd\n",
            "tools/x.py": "from edgerun.model.transformer import T\nimport edgerun.api\n",
            "cli.py": "from edgerun.tools.convert import convert\n",
            "model/x.py": "from edgerun.ops import qmatvec\n",
        },
    )
    assert violations(root) == []


def test_circle_finder_finds_one(tmp_path):
    root = _tree(
        tmp_path,
        {"model/a.py": "from edgerun.model import b\n", "model/b.py": "import edgerun.model.a\n"},
    )
    assert circles(root) == [["edgerun.model.a", "edgerun.model.b"]]
