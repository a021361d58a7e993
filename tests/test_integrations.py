"""The integrations' packaging: ckptd never imports a framework itself, and a missing one is
named with the extra that installs it."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import ckptd, ckptd.integrations
loaded = [m for m in ("lightning", "transformers", "accelerate") if m in sys.modules]
assert not loaded, f"import ckptd imported {loaded}"
for framework in ("lightning", "transformers", "accelerate"):
    sys.modules[framework] = None  # as if it were not installed
    try:
        __import__(f"ckptd.integrations.{framework}")
    except ImportError as exc:
        print(exc)
    else:
        raise AssertionError(f"ckptd.integrations.{framework} imported without {framework}")
"""


def test_a_missing_framework_names_the_extra_to_install() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        f"ckptd.integrations.{extra} needs the {module!r} package, which is not installed: "
        f'pip install "ckptd[{extra}]"'
        for module, extra in (("lightning.fabric.plugins.io", "lightning"), ("transformers", "transformers"),
                              ("accelerate", "accelerate"))
    ]
