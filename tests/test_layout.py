"""The README's layout table against the files: every module of the project's packages is
named in its folder's row, and every file a row names exists (as the settings table is
checked against engine/settings.py in tests/test_config.py)."""

from __future__ import annotations

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
