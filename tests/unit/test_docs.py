"""The docs agree with the code: docs/architectures.md's table is what ``kiln plugins`` prints,
and every relative link of README.md and docs/*.md reaches a file (and a heading) that exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_architectures", ROOT / "docs" / "architectures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_table_is_what_kiln_plugins_prints() -> None:
    script = _script()
    entry = script.plugins_entry()
    table = entry["table"]
    assert table[0] == ["architecture", "fp32", "fp16", "int8", "fp8", "int4", "class", "--target ort", "notes"] and len(table) > 30
    text = script.DOC.read_text()
    assert "| Llama | `pox` | `p-x` | `pOx` | `p-x` | `pox` | `LlamaForCausalLM` | GQA |" in text
    assert script.rewritten(text, script.section(entry)) == text, (
        "docs/architectures.md's architecture table differs from `kiln plugins`; regenerate it: python docs/architectures.py"
    )


def test_the_table_renders_every_row_between_the_markers() -> None:
    script = _script()
    table = [["a", "class", "c"], ["x", "Cls", "p|q"]]
    assert script.markdown_table(table) == "| a | class | c |\n|---|---|---|\n| x | `Cls` | p\\|q |"
    assert script.markdown_table(table, ("a", "c")) == "| a | class | c |\n|---|---|---|\n| `x` | Cls | `p\\|q` |"
    entry = {"table": [["a", "fp32", "class"], ["x", "pox", "Cls"]], "support": [{"fp32": {}}], "legend": ["p portable"]}
    assert script.section(entry) == "| a | fp32 | class |\n|---|---|---|\n| x | `pox` | `Cls` |\n\n- p portable"
    assert script.rewritten(f"head\n{script.BEGIN}\nold\n{script.END}\ntail\n", "T") == f"head\n{script.BEGIN}\nT\n{script.END}\ntail\n"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces -."""
    headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_of_the_docs_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
