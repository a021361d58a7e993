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
  of an object, parsed inside ``{}``);
- other blocks (``text``, and fences without a language: output, file trees) are not code.

A block that cannot run here (it installs systemd units, needs GPUs, several nodes,
a framework's own model, or minutes) is marked on the line before its fence with
``<!-- docs-test: skip REASON -->``; the reason is required, and there should be few.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptd import config as config_mod

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")
SKIP = re.compile(r"^<!-- docs-test: skip (\S.*?) -->$")
RUN = {"python", "sh", "bash", "toml", "json"}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason, when marked

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
        marker = SKIP.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         marker.group(1) if marker else None))
        i = j + 1
    return out


def test_every_skip_marker_sits_on_a_code_block_and_says_why() -> None:
    for page in PAGES:
        lines = page.read_text().split("\n")
        for n, line in enumerate(lines):
            if "docs-test:" not in line:
                continue
            where = f"{page.relative_to(REPO)}:{n + 1}"
            assert SKIP.match(line.strip()), f"{where}: write the marker as <!-- docs-test: skip REASON -->"
            following = [x for x in lines[n + 1:] if x.strip()]
            assert following and FENCE.match(following[0]), f"{where}: the marker is not right before a code block"


# Runs the page's blocks in order in one interpreter; a shell block runs in bash from here.
DRIVER = textwrap.dedent('''
    import json, subprocess, sys, traceback
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
            r = subprocess.run(["bash", "-c", "set -euo pipefail\\n" + b["code"]])
            if r.returncode != 0:
                print(f"FAILED {b['where']}: exit status {r.returncode}", flush=True)
                sys.exit(1)
''')


def check_toml(block: Block, tmp: Path) -> None:
    path = tmp / f"docs-block-{block.line}.toml"
    path.write_text(block.code)
    try:
        config_mod.load(path)
    except config_mod.ConfigError as exc:
        pytest.fail(f"{block.where()}: not a valid ckptd config: {exc}")


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
    for b in found:
        if b.skip is None and b.lang == "toml":
            check_toml(b, tmp_path)
        elif b.skip is None and b.lang == "json":
            check_json(b)
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
# `usage.md` in a page, a docstring or a comment. Pages are merged and renamed; a
# mention left behind would send a reader to nothing.
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
MENTION = re.compile(r"(?<![\w/.-])((?:docs/)?[a-z][a-z0-9-]*\.md)\b")
SOURCES = [*PAGES, *sorted((REPO / "ckptd").rglob("*.py")), *sorted((REPO / "tests").rglob("*.py")),
           *sorted((REPO / "benchmarks").rglob("*.py")), REPO / "benchmarks" / "README.md", REPO / "config.toml"]


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
