"""Every ``ckptd`` command line the README and docs/ show, through the real parser.

A line of a shell code block (```sh, bash, shell or console) that runs ``ckptd``
(``ckptd ...``, ``.venv/bin/ckptd ...``, ``sudo ckptd ...``, also after ``&&``, ``;``
or ``|``) is parsed, never run, with every shell variable (``$i``, ``${HOST}``,
``$(...)``) given the sample value 1. A line the parser refuses fails the test
naming its file and line, whether or not its block is marked ``docs-test: skip``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ckptd.cli import _parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}  # unlabeled blocks hold synopses: `ckptd list [RUN]`
FENCE = re.compile(r"^\s*```(\w*)")
VARIABLE = re.compile(r"\$\((?:[^()]*)\)|\$\{\w+\}|\$\w+")
BETWEEN = re.compile(r"\s*(?:&&|\|\||;|\|(?!\|)|&(?!&))\s*")
PREFIXES = ("sudo", "do", "then", "time", "exec")


def shell_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of each line in ``page``'s shell code blocks, continuations joined."""
    out: list[tuple[int, str]] = []
    label = None
    pending = ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            label = fence.group(1) if label is None else None
            continue
        if label not in SHELL:
            continue
        text = line.strip().removeprefix("$ ")
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append((number, pending + text))
        pending = ""
    return out


def commands(text: str) -> list[list[str]]:
    """The ckptd command lines in one shell line, each as argv after ``ckptd``."""
    words_of = []
    for part in BETWEEN.split(VARIABLE.sub("1", text)):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:  # a quote opened in one part and closed in another: not a ckptd line
            continue
        while words and (words[0] in PREFIXES or re.fullmatch(r"\w+=\S*", words[0])):
            words = words[1:]
        if words and Path(words[0]).name == "ckptd":
            words_of.append(words[1:])
    return words_of


def _found() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for number, text in shell_lines(page):
            for argv in commands(text):
                found.append((f"{page.relative_to(REPO)}:{number}", argv))
    return found


def test_the_docs_show_ckptd_commands() -> None:
    assert len(_found()) >= 5, _found()  # the scan itself still finds what the pages show


@pytest.mark.parametrize("where,argv", _found(), ids=[w for w, _ in _found()])
def test_a_docs_command_line_parses(where: str, argv: list[str], capsys) -> None:
    try:
        _parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 0, f"{where}: `ckptd {shlex.join(argv)}` does not parse: {capsys.readouterr().err}"


@pytest.mark.parametrize("line,argv", [
    ("sudo ckptd keygen 10.0.0.$i-7701 /etc/ckptd/curve   # its pair", ["keygen", "10.0.0.1-7701", "/etc/ckptd/curve"]),
    ("cd x && .venv/bin/ckptd list run | head -1", ["list", "run"]),
    ("for i in 1 2; do CKPTD_CONFIG=c ckptd status --json; done", ["status", "--json"]),
    ("echo ckptd list", []),
])
def test_commands_are_found_where_a_shell_runs_them(line: str, argv: list[str]) -> None:
    assert commands(line) == ([argv] if argv else [])
