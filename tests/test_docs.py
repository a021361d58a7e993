"""Every code block in README.md and docs/*.md runs as pasted, so the docs cannot drift.

One test per page (new pages are picked up by themselves). The page's blocks run in
order, as a reader would paste them, in a fresh folder laid out like a checkout: the
repository's own ``config.toml`` (socket and checkpoints under ``var/``), ``.venv``
pointing at this interpreter's environment, and a real daemon started from that
config, as the README's first command does.

- ``python`` blocks run in one interpreter, one after the other (a page is a session:
  a later block may use what an earlier one made);
- ``sh`` / ``bash`` blocks run in bash (``set -euo pipefail``) between them;
- ``toml`` blocks are loaded as a ckptd config file (every key checked);
- ``json`` blocks parse as JSON (a block that starts with a ``"key":`` is a fragment
  of an object, parsed inside ``{}``); ``yaml`` blocks parse as YAML;
- ``text`` blocks (output, file trees) are not code; every fence names its language.

Variables a shell block exports reach the blocks after it, as in a terminal. Every
``ckptd`` command line of a shell block, run or not, goes through the real parser.

A block that cannot run here is marked on the line before its fence: a block of a
set-up on several nodes with ``<!-- docs-test: cluster REASON -->`` (tests/test_cluster.py
runs those, through ``cluster_blocks()``); one that installs systemd units, needs GPUs,
a framework's own model, or minutes with ``<!-- docs-test: skip REASON -->``. The
reason is required, and there should be few. Every relative link and ``#anchor`` of
the pages resolves.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptd import cli as cli_mod
from ckptd import config as config_mod

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")
MARKER = re.compile(r"^<!-- docs-test: (skip|cluster) (\S.*?) -->$")
RUN = {"python", "sh", "bash", "toml", "json", "yaml"}
LANGUAGES = RUN | {"text"}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason, when marked: the block does not run here
    mark: str | None = None  # "skip", or "cluster": tests/test_cluster.py runs it

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        assert j < len(lines), f"{page.relative_to(REPO)}:{start + 1}: a code block is never closed"
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         marker.group(2) if marker else None, marker.group(1) if marker else None))
        i = j + 1
    return out


def test_every_skip_marker_sits_on_a_code_block_and_says_why() -> None:
    for page in PAGES:
        lines = page.read_text().split("\n")
        for n, line in enumerate(lines):
            if "docs-test:" not in line:
                continue
            where = f"{page.relative_to(REPO)}:{n + 1}"
            assert MARKER.match(line.strip()), \
                f"{where}: write the marker as <!-- docs-test: skip REASON --> or <!-- docs-test: cluster REASON -->"
            following = [x for x in lines[n + 1:] if x.strip()]
            assert following and FENCE.match(following[0]), f"{where}: the marker is not right before a code block"


# Runs the page's blocks in order in one interpreter; a shell block runs in bash from here,
# and what it exports is kept for the blocks after it.
DRIVER = textwrap.dedent('''
    import json, os, subprocess, sys, traceback
    SHELL_OWN = {"_", "PWD", "OLDPWD", "SHLVL"}
    ns = {"__name__": "__main__"}
    for b in json.load(open(sys.argv[1])):
        print(f"--- docs block {b['where']} ({b['lang']})", flush=True)
        if b["lang"] == "python":
            try:
                exec(compile(b["code"], b["where"], "exec"), ns)
            except BaseException:
                traceback.print_exc()
                print(f"FAILED {b['where']}", flush=True)
                sys.exit(1)
        else:
            script = "set -euo pipefail\\n" + b["code"] + "\\nenv -0 > .docs-env"
            r = subprocess.run(["bash", "-c", script])
            if r.returncode != 0:
                print(f"FAILED {b['where']}: exit status {r.returncode}", flush=True)
                sys.exit(1)
            exported = dict(v.split("=", 1) for v in open(".docs-env").read().split("\\0") if "=" in v)
            os.environ.update({k: v for k, v in exported.items() if k not in SHELL_OWN and os.environ.get(k) != v})
''')


def check_toml(block: Block, tmp: Path) -> None:
    path = tmp / f"docs-block-{block.line}.toml"
    path.write_text(block.code)
    try:
        config_mod.load(path)
    except config_mod.ConfigError as exc:
        pytest.fail(f"{block.where()}: not a valid ckptd config: {exc}")


def check_yaml(block: Block) -> None:
    yaml = pytest.importorskip("yaml")
    try:
        yaml.safe_load(block.code)
    except yaml.YAMLError as exc:
        pytest.fail(f"{block.where()}: not YAML: {exc}")


def check_json(block: Block) -> None:
    text = block.code.strip()
    try:
        json.loads("{" + text + "}" if text.startswith('"') else text)
    except json.JSONDecodeError as exc:
        pytest.fail(f"{block.where()}: not JSON: {exc}")


def checkout(tmp: Path) -> Path:
    """A folder laid out like a set-up checkout: config.toml, .venv, examples/."""
    shutil.copy(REPO / "config.toml", tmp / "config.toml")
    os.symlink(sys.prefix, tmp / ".venv")
    shutil.copytree(REPO / "examples", tmp / "examples")
    return tmp


def start_daemon(tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(tmp / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "-c", "config.toml"], cwd=tmp, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while subprocess.run([sys.executable, "-m", "ckptd", "status", "-c", "config.toml", "--timeout", "2"],
                         cwd=tmp, env=env, capture_output=True).returncode != 0:
        assert proc.poll() is None, (tmp / "daemon.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the daemon did not answer within 60 s"
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_code_blocks_run_as_pasted(page: Path, tmp_path: Path) -> None:
    found = [b for b in blocks(page) if b.lang in RUN]
    for b in found:  # a config or a fragment is checked even where the set-up around it cannot run here
        if b.mark != "skip" and b.lang == "toml":
            check_toml(b, tmp_path)
        elif b.mark != "skip" and b.lang == "json":
            check_json(b)
        elif b.mark != "skip" and b.lang == "yaml":
            check_yaml(b)
    runnable = [b for b in found if b.skip is None and b.lang in ("python", "sh", "bash")]
    for b in runnable:  # never run as root what changes the machine
        assert not re.search(r"\b(sudo|systemctl|usermod|apt-get)\b", b.code), \
            f"{b.where()}: it changes the system; mark it <!-- docs-test: skip REASON -->"
    if not runnable:
        return
    tmp = checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's ckptd, whatever .venv has installed
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    daemon = start_daemon(tmp, env)
    try:
        (tmp / "blocks.json").write_text(json.dumps(
            [{"where": b.where(), "lang": b.lang, "code": b.code} for b in runnable]))
        (tmp / "driver.py").write_text(DRIVER)
        r = subprocess.run([sys.executable, "driver.py", "blocks.json"], cwd=tmp, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()


# A page named anywhere: a markdown link's target, or a mention such as docs/format.md or
# `tiers.md` in a page, a docstring or a comment. Pages are merged and renamed; a
# mention left behind would send a reader to nothing.
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
MENTION = re.compile(r"(?<![\w/.-])((?:docs/)?[a-z][a-z0-9-]*\.md)\b")
SOURCES = [*PAGES, *sorted((REPO / "ckptd").rglob("*.py")), *sorted((REPO / "tests").rglob("*.py")),
           *sorted((REPO / "benchmarks").rglob("*.py")), *sorted((REPO / "examples").rglob("*.py")),
           REPO / "benchmarks" / "README.md", REPO / "config.toml"]


def test_every_page_named_exists() -> None:
    missing = []
    for source in SOURCES:
        text = source.read_text()
        for n, line in enumerate(text.split("\n"), 1):
            for target in LINK.findall(line):
                if "://" not in target and not (source.parent / target).resolve().is_file():
                    missing.append(f"{source.relative_to(REPO)}:{n}: link to {target}")
            for name in MENTION.findall(line):
                path = REPO / name if name.startswith("docs/") else REPO / "docs" / name
                if not path.is_file() and not (REPO / name).is_file() and not (source.parent / name).is_file():
                    missing.append(f"{source.relative_to(REPO)}:{n}: names {name}")
    assert not missing, "pages that do not exist:\n" + "\n".join(missing)


def cluster_blocks() -> list[Block]:
    """The blocks marked ``cluster``, page by page in order: tests/test_cluster.py runs them."""
    return [b for page in PAGES for b in blocks(page) if b.mark == "cluster"]


def test_every_code_block_names_its_language() -> None:
    unnamed = [f"{b.where()}: ```{b.lang}" for page in PAGES for b in blocks(page) if b.lang not in LANGUAGES]
    assert not unnamed, "fences must name one of " + ", ".join(sorted(LANGUAGES)) + " (text: output, trees):\n" \
        + "\n".join(unnamed)


# A markdown link: [text](target) or [text](target#anchor) or [text](#anchor); not inside code.
MD_LINK = re.compile(r"\]\(([^)\s]*)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$")


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside code blocks, with their numbers."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text().split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def anchors(page: Path) -> set[str]:
    found: dict[str, int] = {}
    for _, line in prose(page):
        m = HEADING.match(line)
        if m:
            slug = anchor(m.group(1))
            found[slug] = found.get(slug, -1) + 1
    return {slug if i == 0 else f"{slug}-{i}" for slug, count in found.items() for i in range(count + 1)}


def test_every_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for n, line in prose(page):
            for target in MD_LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if "://" in target or target.startswith("mailto:"):
                    continue
                path, _, fragment = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{n}: {target}"
                if not dest.exists():
                    broken.append(f"{where}: no such file")
                elif fragment and (dest.suffix != ".md" or fragment not in anchors(dest)):
                    broken.append(f"{where}: no heading with that anchor in {dest.name}")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def ckptd_commands(code: str) -> list[list[str]]:
    """The argument lists of every ckptd command in a shell block (after sudo, VAR=value, env)."""
    commands = []
    for line in code.replace("\\\n", " ").split("\n"):
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
        except ValueError:
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|", "&", "(", ")"):
                while command and (command[0] in ("sudo", "env", "nice") or re.match(r"^[A-Z_]+=", command[0])):
                    command.pop(0)
                if command and command[0].endswith("ckptd") and "/" not in command[0].replace(".venv/bin/", ""):
                    commands.append(command[1:])
                elif command[1:3] == ["-m", "ckptd"]:
                    commands.append(command[3:])
                command = []
            else:
                command.append(word)
    return commands


def test_every_ckptd_command_in_the_docs_parses() -> None:
    """Run or not, every `ckptd ...` line of a shell block is one the command line takes."""
    parser = cli_mod._parser()
    wrong, seen = [], 0
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in ("sh", "bash"):
                continue
            for args in ckptd_commands(b.code):
                seen += 1
                try:
                    parser.parse_args(args)
                except SystemExit:
                    wrong.append(f"{b.where()}: ckptd {shlex.join(args)}")
    assert seen >= 10, f"only {seen} ckptd commands found in the docs: is the reader of shell blocks broken?"
    assert not wrong, "commands the ckptd parser refuses:\n" + "\n".join(wrong)


def test_the_command_reader_finds_ckptd_wherever_it_stands() -> None:
    found = ckptd_commands("sudo AWS_ENDPOINT_URL=http://x .venv/bin/ckptd install-systemd && systemctl restart ckptd\n"
                           "ckptd keygen a --dir b   # a comment\n"
                           "python -m ckptd status --json | head -1\n")
    assert found == [["install-systemd"], ["keygen", "a", "--dir", "b"], ["status", "--json"]], found


# A section cited by name beside its page: docs/tiers.md, "Placement" (or \"...\" inside a string).
SECTION = re.compile(r"(?:docs/)?([a-z][a-z0-9-]*\.md)`?,? \(?\\?\"([^\"\\]{3,80})\\?\"")


def sections(page: Path) -> set[str]:
    """A page's headings and bold paragraph labels (**Label.**), as a citation names them."""
    found = set()
    for _, line in prose(page):
        heading = HEADING.match(line)
        if heading:
            found.add(heading.group(1).replace("`", "").strip().lower())
        found.update(label.rstrip(".:").lower() for label in re.findall(r"\*\*([^*]+?)\*\*", line))
    return found


def test_every_section_cited_exists() -> None:
    missing = []
    for source in SOURCES:
        for n, line in enumerate(source.read_text().split("\n"), 1):
            for name, title in SECTION.findall(line):
                page = REPO / "docs" / name
                if page.is_file() and title.lower() not in sections(page):
                    missing.append(f"{source.relative_to(REPO)}:{n}: {name}, \"{title}\"")
    assert not missing, "sections cited that their page does not have:\n" + "\n".join(missing)


def test_the_readme_headline_figures_are_the_performance_page_s() -> None:
    """Every figure the README's "Why ckptd" quotes stands on docs/performance.md."""
    readme = (REPO / "README.md").read_text()
    why = readme[readme.index("## Why ckptd"):readme.index("\n## ", readme.index("## Why ckptd") + 1)]
    quoted = set(re.findall(r"\d+\.\d+", why))
    measured = set(re.findall(r"\d+\.\d+", (REPO / "docs" / "performance.md").read_text()))
    assert len(quoted) >= 5, f"the README's headline quotes {sorted(quoted)}: few figures for a headline"
    assert quoted <= measured, f"figures in the README that docs/performance.md does not have: {sorted(quoted - measured)}"
