"""The docs agree with the code: docs/architectures.md's table is what ``kiln plugins`` prints,
and every relative link of README.md and docs/*.md reaches a file (and a heading) that exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import click

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
    assert (
        table[0] == ["architecture", "fp32", "fp16", "int8", "fp8", "int4", "class", "--target ort", "notes"]
        and len(table) > 30
    )
    text = script.DOC.read_text()
    assert "| Llama | `pox` | `p-x` | `pOx` | `p-x` | `pox` | `LlamaForCausalLM` | GQA |" in text
    assert script.rewritten(text, script.section(entry)) == text, (
        "docs/architectures.md's architecture table differs from `kiln plugins`; regenerate it: python "
        "docs/architectures.py"
    )


def test_the_table_renders_every_row_between_the_markers() -> None:
    script = _script()
    table = [["a", "class", "c"], ["x", "Cls", "p|q"]]
    assert script.markdown_table(table) == "| a | class | c |\n|---|---|---|\n| x | `Cls` | p\\|q |"
    assert script.markdown_table(table, ("a", "c")) == "| a | class | c |\n|---|---|---|\n| `x` | Cls | `p\\|q` |"
    entry = {
        "table": [["a", "fp32", "class"], ["x", "pox", "Cls"]],
        "support": [{"fp32": {}}],
        "legend": ["p portable"],
    }
    assert script.section(entry) == "| a | fp32 | class |\n|---|---|---|\n| x | `pox` | `Cls` |\n\n- p portable"
    assert (
        script.rewritten(f"head\n{script.BEGIN}\nold\n{script.END}\ntail\n", "T")
        == f"head\n{script.BEGIN}\nT\n{script.END}\ntail\n"
    )


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


SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")  # a code span (one backtick each side), which may wrap a line


def _code_lines(text: str) -> tuple[list[tuple[int, str]], str]:
    """(line, command line) of every code block line starting with ``kiln `` (an indented or fenced
    block, a backslash joining the next line; ``&& kiln`` parts too), and the text outside blocks
    (block lines blanked, so a span's offset still gives its line)."""
    found: list[tuple[int, str]] = []
    prose: list[str] = []
    fenced, previous_blank, indented = False, True, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            prose.append("")
            continue
        indented = line.startswith("    ") and line.strip() != "" and (indented or previous_blank)
        previous_blank = not line.strip()
        if not (fenced or indented):
            prose.append(line)
            continue
        prose.append("")
        code = line.strip()
        if found and found[-1][1].endswith("\\"):
            found[-1] = (found[-1][0], found[-1][1][:-1].rstrip() + " " + code)
        elif code.startswith("kiln ") or "&& kiln " in code:
            found.append((number, code))
    return found, "\n".join(prose)


def kiln_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, words) of every ``kiln ...`` command a Markdown page names in a code span or a code
    block, each from ``kiln`` to the end of its command (a ``&&``, ``|`` or ``;`` ends one)."""
    blocks, prose = _code_lines(text)
    spans = [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in SPAN.finditer(prose)]
    commands = []
    for number, code in [*blocks, *spans]:
        words = code.split("#", 1)[0].split() if code.startswith("kiln ") or "&& kiln " in code else []
        while "kiln" in words:
            words = words[words.index("kiln") :]
            end = next((i for i, w in enumerate(words) if w in ("&&", "|", ";", "||")), len(words))
            commands.append((number, words[:end]))
            words = words[end:]
    return sorted(commands)


def _resolve(words: list[str]) -> tuple[click.Command, list[str]] | str:
    """The click command ``words`` (``kiln`` first) names and the words after its name, or why none."""
    from kiln.cli import main

    command: click.Command = main
    rest = words[1:]
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        found = command.commands.get(rest[0])
        if found is None:
            return f"{' '.join(words[: len(words) - len(rest)])} has no command {rest[0]!r}"
        command, rest = found, rest[1:]
    return command, rest


def _placeholder(value: str) -> bool:
    """A value the page stands in for (``NAME``, ``a|b``, ``<dir>``, ``...``), not a literal one."""
    return value.isupper() or any(c in value for c in "|<>[]{}") or value.endswith("...")


def cli_mismatches(page: str, text: str) -> list[str]:
    """ "page:line: why" for each command, option or choice a page names that the CLI lacks."""
    wrong = []
    for number, words in kiln_commands(text):
        resolved = _resolve(words)
        if isinstance(resolved, str):
            wrong.append(f"{page}:{number}: {resolved}")
            continue
        command, rest = resolved
        params = {
            name: p for p in command.get_params(click.Context(command)) for name in (*p.opts, *p.secondary_opts)
        }  # + --help
        for i, word in enumerate(rest):
            name = word.split("=", 1)[0]
            if not name.startswith("--"):
                continue
            param = params.get(name)
            if param is None:
                wrong.append(f"{page}:{number}: `{' '.join(words)}`: {command.name} has no option {name}")
                continue
            after = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("-") else None
            value = word.split("=", 1)[1] if "=" in word else after
            choices = param.type.choices if isinstance(param.type, click.Choice) else None
            flag = isinstance(param, click.Option) and param.is_flag
            if choices is None or flag or value is None or _placeholder(value) or value.strip("\"'`") in choices:
                continue
            wrong.append(
                f"{page}:{number}: `{' '.join(words)}`: {name} takes {', '.join(map(str, choices))}, not {value}"
            )
    return wrong


def test_the_cli_checker_names_the_page_and_line_of_what_the_cli_lacks() -> None:
    text = (
        "Run `kiln check\n  --backend tensorrt DIR` or\n\n    kiln export --model demo \\\n        --fp17 --out x\n\n"
        "then `kiln frobnicate --json`, `kiln build DIR --graphs onnx --help`, `kiln.exporter` and `kiln --version`.\n"
        "```\nkiln verify --deep\n```\n"
    )
    assert cli_mismatches("p.md", text) == [
        "p.md:1: `kiln check --backend tensorrt DIR`: --backend takes onnxruntime, trt, not tensorrt",
        "p.md:4: `kiln export --model demo --fp17 --out x`: export has no option --fp17",
        "p.md:7: kiln has no command 'frobnicate'",
        "p.md:9: `kiln verify --deep`: verify has no option --deep",
    ]


def test_every_command_and_option_the_docs_name_is_in_the_cli() -> None:
    named = [(page, kiln_commands(page.read_text())) for page in PAGES]
    assert sum(len(commands) for _, commands in named) > 100, "the docs' kiln commands were not found"
    wrong = [w for page in PAGES for w in cli_mismatches(page.relative_to(ROOT).as_posix(), page.read_text())]
    assert not wrong, "a page names a kiln command, option or choice the CLI does not have:\n" + "\n".join(wrong)
