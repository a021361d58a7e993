"""Every key the config parser takes is documented, with the parser's default.

The keys come from the parser itself (``ckptd.config.tables()``: each table's
dataclass, whose fields with a ``parse`` are its keys), so a key added later
without docs fails here. Two places must hold each one:

- ``config.toml``: as ``key = VALUE``, or commented out as ``# key = VALUE`` (an
  optional key shown but not set), and either way VALUE parses to the default;
- ``docs/configuration.md``: a row ``| `key` | type | `DEFAULT` | meaning |`` in the
  table under its heading ``### `[table]```, DEFAULT parsing to the default.

Keys documented there that the parser does not take fail too: the docs would
promise a key that is an error.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd import config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
CONFIG_TOML = REPO / "config.toml"
CONFIG_DOC = REPO / "docs" / "configuration.md"

HEADER = re.compile(r"^#?\s*\[([a-z0-9_.]+)\]\s*$")
KEY_LINE = re.compile(r"^(#\s*)?([a-z_][a-z0-9_]*)\s*=\s*(\S.*?)\s*$")
DOC_HEADING = re.compile(r"^#{2,4} `\[([a-z0-9_.]+)\]`\s*$")
DOC_ROW = re.compile(r"^\| `([a-z_][a-z0-9_]*)` \|([^|]*)\| `([^`]*)` \|(.*)\|\s*$")


def parser_keys(tables: dict[str, type]) -> dict[str, dict[str, dataclasses.Field]]:
    """table -> key -> the dataclass field that parses it."""
    return {name: {f.name: f for f in dataclasses.fields(cls) if "parse" in f.metadata}
            for name, cls in tables.items()}


def parse_value(text: str) -> Any:
    """A TOML value as written after ``key =`` (an inline comment allowed)."""
    return tomllib.loads(f"v = {text}")["v"]


def default_problem(table: str, key: str, f: dataclasses.Field, written: str, where: str) -> str | None:
    """Why ``written`` does not state ``f``'s default (None when it does)."""
    try:
        value = f.metadata["parse"](parse_value(written))
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        return f"{where}: [{table}] {key} = {written}: not a valid value ({exc})"
    if value != f.default:
        return f"{where}: [{table}] {key} = {written} gives {value!r}; the parser's default is {f.default!r}"
    return None


def toml_entries(text: str) -> dict[str, dict[str, tuple[str, int]]]:
    """table -> key -> (value as written, line), active or commented out."""
    out: dict[str, dict[str, tuple[str, int]]] = {}
    table = None
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        header = HEADER.match(stripped)
        if header:
            table = header.group(1)
            out.setdefault(table, {})
            continue
        m = KEY_LINE.match(stripped)
        if m and table is not None:
            out[table].setdefault(m.group(2), (m.group(3), n))
    return out


def toml_problems(tables: dict[str, type], text: str) -> list[str]:
    keys = parser_keys(tables)
    found = toml_entries(text)
    problems = []
    for table, fields in keys.items():
        entries = found.get(table)
        if entries is None:
            problems.append(f"config.toml has no [{table}] table (write it, commented out if optional)")
            continue
        for key, f in fields.items():
            if key not in entries:
                problems.append(f"config.toml: [{table}] has no {key} (write `{key} = ...` or `# {key} = ...`)")
                continue
            written, line = entries[key]
            problem = default_problem(table, key, f, written, f"config.toml:{line}")
            if problem:
                problems.append(problem)
    # only active keys: a commented line may be prose that happens to read "word = ..."
    active = tomllib.loads(text)
    for table, values in active.items():
        for key, value in values.items():
            if table in keys and not isinstance(value, dict) and key not in keys[table]:
                problems.append(f"config.toml: [{table}] {key} is not a key the parser takes")
    return problems


def doc_rows(text: str) -> dict[str, dict[str, tuple[str, str, str, int]]]:
    """table -> key -> (type, default, meaning, line) from the page's key tables."""
    out: dict[str, dict[str, tuple[str, str, str, int]]] = {}
    table = None
    for n, line in enumerate(text.split("\n"), 1):
        heading = DOC_HEADING.match(line)
        if heading:
            table = heading.group(1)
            out.setdefault(table, {})
            continue
        if line.startswith("#"):
            table = None
            continue
        m = DOC_ROW.match(line)
        if m and table is not None:
            out[table][m.group(1)] = (m.group(2).strip(), m.group(3), m.group(4).strip(), n)
    return out


def doc_problems(tables: dict[str, type], text: str) -> list[str]:
    keys = parser_keys(tables)
    found = doc_rows(text)
    problems = []
    for table, fields in keys.items():
        rows = found.get(table)
        if rows is None:
            problems.append(f"docs/configuration.md has no section ### `[{table}]`")
            continue
        for key, f in fields.items():
            if key not in rows:
                problems.append(f"docs/configuration.md: [{table}] has no row for `{key}`")
                continue
            kind, default, meaning, line = rows[key]
            where = f"docs/configuration.md:{line}"
            if not kind or not meaning:
                problems.append(f"{where}: [{table}] {key}: say its type and what it does")
            problem = default_problem(table, key, f, default, where)
            if problem:
                problems.append(problem)
        for key in rows.keys() - fields.keys():
            problems.append(f"docs/configuration.md:{rows[key][3]}: [{table}] {key} is not a key the parser takes")
    for table in found.keys() - keys.keys():
        problems.append(f"docs/configuration.md: [{table}] is not a table the parser takes")
    return problems


def test_the_parser_has_the_tables_it_says() -> None:
    tables = config.tables()
    assert {"daemon", "producer", "retention", "index", "hdf5", "remote", "remote.retention", "peer",
            "advise"} <= tables.keys()
    keys = parser_keys(tables)
    # keys the docs once left out: the introspection must see them
    assert {"attempt"} <= keys["producer"].keys() and {"mtbf"} <= keys["advise"].keys()
    assert {"observer", "rescan_interval"} <= keys["index"].keys()


def test_config_toml_has_every_key_with_its_default() -> None:
    problems = toml_problems(config.tables(), CONFIG_TOML.read_text())
    assert not problems, "\n".join(problems)


def test_configuration_page_has_every_key_with_its_default() -> None:
    problems = doc_problems(config.tables(), CONFIG_DOC.read_text())
    assert not problems, "\n".join(problems)


def test_the_shipped_config_is_the_defaults_in_every_table() -> None:
    cfg = config.load(CONFIG_TOML)
    for name in config.tables():
        table, _, sub = name.partition(".")
        loaded, default = getattr(cfg, table), getattr(config.Config(), table)
        if sub:
            loaded, default = getattr(loaded, sub), getattr(default, sub)
        assert loaded == default, f"[{name}] in config.toml differs from the built-in defaults"


def test_writer_threads_comment_matches_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """config.toml says what 0 gives on a machine of some size: the code must agree."""
    comment = " ".join(line.lstrip("# ") for line in CONFIG_TOML.read_text().split("\n") if line.startswith("#"))
    claims = re.findall(r"\((\d+) on a (\d+)-core machine", comment)
    assert claims, "config.toml no longer says what writer_threads = 0 gives on a small machine"
    for threads, cores in claims:
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: int(cores))
        assert config.writer_threads(0) == int(threads), f"config.toml: {threads} threads on {cores} cores"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Undocumented:
    """A table whose second key no file documents, and whose first has a new default."""

    chunk_size: int = dataclasses.field(default=1, metadata={"parse": config.parse_size})
    brand_new: int = dataclasses.field(default=0, metadata={"parse": config.parse_size})


def test_the_checks_catch_an_undocumented_key_and_a_wrong_default() -> None:
    tables = dict(config.tables(), daemon=_Undocumented)
    toml = toml_problems(tables, CONFIG_TOML.read_text())
    doc = doc_problems(tables, CONFIG_DOC.read_text())
    for problems in (toml, doc):
        text = "\n".join(problems)
        assert "brand_new" in text and "chunk_size" in text and "endpoint" in text, text
