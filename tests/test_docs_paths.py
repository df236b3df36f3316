"""The docs name modules and files of the code as they are: every ``dcr_format.x.y`` name and
every ``folder/module.py`` path in README.md, docs/ and spec/FORMAT.md exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "spec" / "FORMAT.md", *(ROOT / "docs").glob("*.md")])
PACKAGE = ROOT / "dcr_format"
# folders a path may start with: the package's own, and the checkout's
FOLDERS = {p.name for p in PACKAGE.iterdir() if p.is_dir()} | {
    "dcr_format",
    "benchmarks",
    "tests",
    "tests_vllm",
    "tests_sglang",
    "spec",
    "docs",
}
DOTTED = re.compile(r"dcr_format(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"`((?:[a-z_]+/)+[\w.]+\.(?:py|json|sh))\b")


def _resolves(name: str) -> bool:
    """``name`` is a module, or an attribute reached from the longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _exists(path: str) -> bool:
    return (ROOT / path).exists() or (PACKAGE / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = sorted({m for m in DOTTED.findall(text) if not _resolves(m)})
    missing += sorted(
        {
            p
            for p in PATH.findall(text)
            if p.split("/")[0] in FOLDERS and not _exists(p) and "<" not in p
        }
    )
    assert missing == [], f"{doc.name} names what the code does not have: {missing}"


_DCR_CALL = re.compile(r"\bdcr ([a-z]+)((?:[ \t]+[^\s`|#;)]+)*)")


def _dcr_calls(text: str) -> list[tuple[str, str]]:
    """``(command, its arguments)`` of every ``dcr ...`` in a code line or a code span."""
    calls = []
    for line in text.splitlines():
        code = line.startswith(("    ", "$ "))
        for part in [line] if code else re.findall(r"`([^`]*)`", line):
            calls += [(m.group(1), m.group(2)) for m in _DCR_CALL.finditer(part)]
    return calls


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dcr_option_a_doc_shows_exists(doc: Path) -> None:
    import click

    from dcr_format.cli.main import COMMAND_MODULES, cli

    ctx = click.Context(cli)
    missing = []
    for command, args in _dcr_calls(doc.read_text()):
        if command not in COMMAND_MODULES:  # `dcr over S3` in a table of results
            continue
        found = cli.get_command(ctx, command)
        assert found is not None
        options = {o for p in found.params for o in p.opts} | {"--help"}
        missing += [
            f"dcr {command} {flag}"
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args)
            if flag not in options
        ]
    assert missing == [], f"{doc.name} shows options dcr does not have: {missing}"


def test_the_readme_lists_the_dcr_commands_there_are() -> None:
    from dcr_format.cli.main import COMMAND_MODULES

    text = (ROOT / "README.md").read_text()
    match = re.search(r"^- \*\*The `dcr` command\*\*(.*?)^- ", text, re.S | re.M)
    assert match, "README.md lost its '- **The `dcr` command**' bullet"
    assert set(re.findall(r"`(\w+)`", match.group(1))) == set(COMMAND_MODULES)
