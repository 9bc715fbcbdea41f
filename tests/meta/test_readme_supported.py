"""README's "Supported models" section and `edgerun info --supported` list every architecture
family (edgerun.arch.FAMILIES) and every tensor type (edgerun.quant.formats.FORMATS): read from
the tables, so a family or type added there without README fails here."""

from __future__ import annotations

import re
from pathlib import Path

from edgerun.arch import FAMILIES
from edgerun.cli import main
from edgerun.quant.formats import FORMATS

README = Path(__file__).resolve().parents[2] / "README.md"
REGENERATE = (
    "regenerate README.md's block between '<!-- supported: ... -->' and '<!-- /supported -->' "
    "with `python -m edgerun info --supported --markdown`"
)


def _section() -> str:
    m = re.search(r"<!-- supported:[^>]*-->\n(.*?)<!-- /supported -->", README.read_text(), re.S)
    assert m, f"README.md has no Supported models block: {REGENERATE}"
    return m.group(1)


def test_readme_lists_every_family_and_type():
    section = _section()
    missing = [f"family {n!r}" for n in FAMILIES if f"`{n}`" not in section]
    missing += [f"type {q.name!r}" for q in FORMATS if f"`{q.name}`" not in section]
    assert not missing, f"README.md does not list {', '.join(missing)}: {REGENERATE}"


def test_info_supported_lists_every_family_and_type(capsys):
    assert main(["info", "--supported"]) == 0
    out = capsys.readouterr().out
    for name in FAMILIES:
        assert re.search(rf"^  {re.escape(name)} ", out, re.M), (name, out)
    types = re.findall(r"types[^:]*: (.*)", out)
    listed = {t.strip() for line in types for t in line.split(",")}
    assert listed == {q.name for q in FORMATS}, (listed, out)
