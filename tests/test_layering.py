"""The package's layers: dependencies point down the data flow.

formats/ and quant/ describe bytes (layouts, quantize, dequantize) and know no kernels
and no model; ops/ holds the kernels and knows no model and no file format; tools/ runs
the model (conversion with calibration, perplexity) and only the entry points use it.

Every import of every module under edgerun/ is checked: top level and inside functions,
`import x` and `from x import y`, relative ones resolved, plus
`importlib.import_module("...")` with a constant name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "edgerun"

_MODEL = ("model", "kvcache", "weights", "ffn", "api", "engine", "tools")

# layer (a subpackage of edgerun) -> modules of edgerun it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "quant": ("ops", *_MODEL, "sched"),
    "formats": ("ops", *_MODEL),
    "ops": (*_MODEL, "formats"),
}

# modules (relative to edgerun/, a trailing "/" for a package) that may import tools/
TOOLS_USERS = ("tools/", "cli.py", "api.py", "bench.py", "bench_suite.py")


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


def _hits(mod: str, banned: str) -> bool:
    target = f"edgerun.{banned}"
    return mod == target or mod.startswith(target + ".")


def violations(root: Path = PKG) -> list[str]:
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        layer = rel.split("/", 1)[0] if "/" in rel else None
        banned = FORBIDDEN.get(layer, ())
        may_use_tools = any(
            rel == u or (u.endswith("/") and rel.startswith(u)) for u in TOOLS_USERS
        )
        seen: set[tuple[int, str]] = set()
        for line, mod, text in imports_of(path, root):
            rules = [b for b in banned if _hits(mod, b)]
            if not may_use_tools and _hits(mod, "tools") and "tools" not in rules:
                rules.append("tools")
            for b in rules:
                key = (line, b)
                if key in seen:
                    continue
                seen.add(key)
                who = f"{layer}/" if layer in FORBIDDEN else "a module below tools/"
                bad.append(
                    f"edgerun/{rel}:{line}: {text!r} -> {mod} ({who} must not import edgerun.{b})"
                )
    return bad


def test_layers_import_only_downwards():
    bad = violations()
    assert not bad, "layering violations:\n" + "\n".join(bad)


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
        ("quant/x.py", "def f():\n    from edgerun import model\n", "quant/x.py:2"),
        ("quant/x.py", "from ..ops.qmatvec import matvec\n", "edgerun.ops"),
        ("quant/x.py", "from .. import sched\n", "edgerun.sched"),
        ("formats/x.py", "def f():\n    import edgerun.weights\n", "formats/x.py:2"),
        ("formats/x.py", "import importlib\nimportlib.import_module('edgerun.api')\n", ":2"),
        ("ops/x.py", "from edgerun.formats.gguf import read_gguf\n", "edgerun.formats"),
        ("ops/x.py", "from edgerun.kvcache import KVCache\n", "edgerun.kvcache"),
        ("model.py", "from edgerun.tools.calibrate import collect_imatrix\n", "edgerun.tools"),
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
            "tools/x.py": "from edgerun.model import Transformer\nimport edgerun.ops.qmatvec\n",
            "cli.py": "from edgerun.tools.convert import convert\n",
            "model.py": "from edgerun.ops import qmatvec\n",
        },
    )
    assert violations(root) == []
