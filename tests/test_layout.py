"""The README's layout table against the files: every module of the project's packages is
named in its folder's row, and every file a row names exists (as the settings table is
checked against engine/settings.py in tests/test_config.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("chat", "service", "engine", "api", "store", "bench", "tools")


def layout_rows() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| path | what |"):]
    table = table[:table.index("\n\n")]
    rows = {}
    for row in table.splitlines()[2:]:
        cells = row.split("|")
        rows[cells[1].strip().strip("`")] = cells[2]
    return rows


def test_the_readmes_layout_names_every_module_and_only_modules_that_exist():
    rows = layout_rows()
    missing, stale = {}, {}
    for folder in FOLDERS:
        row = rows[f"{folder}/"]
        named = set(re.findall(r"`([a-z_0-9]+\.py)`", row))
        files = {p.name for p in (ROOT / folder).glob("*.py")
                 if p.name not in ("__init__.py", "__main__.py")}
        if files - named:
            missing[folder] = sorted(files - named)
        if named - files:
            stale[folder] = sorted(named - files)
    assert missing == {} and stale == {}, (missing, stale)
    assert (ROOT / "app.py").is_file() and "Chainlit hooks" in rows["app.py"]
    top = {p.name for p in ROOT.glob("*.py")}
    assert top == {name for name in rows if name.endswith(".py")}, "a top-level module's row"


# What each layer may not import (anywhere in its files, functions included): the Chainlit
# boundary is chat/, app.py and launcher.py; engine/ and store/ are the bottom, side by side;
# service/ is above them, api/ and chat/ above it.
FORBIDDEN = {
    "engine": {"chainlit", "chat", "api", "service", "store", "app", "launcher"},
    "store": {"chainlit", "chat", "api", "service", "app", "launcher"},
    "service": {"chainlit", "chat", "api", "app", "launcher"},
    "api": {"chainlit", "chat", "app", "launcher"},
}


def imported(path: Path) -> set[str]:
    """The top-level package of every module `path` imports (relative imports: its own)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_each_layer_imports_only_the_layers_below_it():
    crossing = {}
    for folder, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            if bad := imported(path) & forbidden:
                crossing[f"{folder}/{path.name}"] = sorted(bad)
    assert crossing == {}


def test_only_the_benchs_own_tests_import_it():
    """bench/ is a tool: the product's tests share what they need through tools/."""
    importing = sorted(p.name for p in (ROOT / "tests").rglob("test_*.py")
                       if "node_modules" not in p.parts and "bench" in imported(p))
    assert [name for name in importing
            if not name.startswith(("test_bench_", "test_serve_compare"))] == []
    tools = {p.name for p in (ROOT / "tools").glob("*.py") if "bench" in imported(p)}
    assert tools == set(), tools
