"""Every exception class lives in ckptd/errors.py, and the names it had elsewhere still work."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from ckptd import errors

PACKAGE = Path(errors.__file__).resolve().parent


def exception_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """Classes whose bases name an exception (``...Error``, ``Exception``, one of errors.py's)."""
    ours = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, BaseException)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases}
            if bases & ours or any(b.endswith(("Error", "Exception", "Warning")) for b in bases):
                found.append(node)
    return found


def test_no_public_exception_class_outside_errors_py() -> None:
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in exception_classes(ast.parse(path.read_text())):
            if not node.name.startswith("_"):  # a private one never leaves its module
                stray.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: class {node.name}")
    assert not stray, "define these in ckptd/errors.py (and import them where they were):\n" + "\n".join(stray)


def test_the_scan_sees_an_exception_class() -> None:
    tree = ast.parse("class Boom(RuntimeError):\n    pass\nclass Other(CheckpointError):\n    pass\n"
                     "class Plain:\n    pass\n")
    assert [c.name for c in exception_classes(tree)] == ["Boom", "Other"]


@pytest.mark.parametrize("module, name, home", [
    ("ckptd.remote.store", "RemoteError", "RemoteError"),
    ("ckptd.remote.store", "RemoteAuthError", "RemoteAuthError"),
    ("ckptd.daemon.owners", "NotOwner", "NotOwner"),
    ("ckptd.daemon.assembly", "StepError", "StepError"),
    ("ckptd.failpoints", "Failpoint", "Failpoint"),
    ("ckptd.transport.handoff", "HandoffRefused", "HandoffRefused"),
    ("ckptd.peer.messages", "PeerDown", "PeerDown"),
    ("ckptd.peer.messages", "PeerRefused", "PeerRefused"),
    ("ckptd.peer.holder", "Full", "PeerMemoryFull"),
    ("ckptd.peer.messages", "Refused", "PeerRequestRefused"),
    ("ckptd.peer.messages", "PeerVersion", "PeerVersion"),
    ("ckptd.tiers", "TierUnavailable", "TierUnavailable"),
])
def test_old_import_names_still_work(module: str, name: str, home: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, home)


def test_remote_errors_are_checkpoint_errors() -> None:
    assert issubclass(errors.RemoteAuthError, errors.RemoteError)
    assert issubclass(errors.RemoteError, errors.CheckpointError)
