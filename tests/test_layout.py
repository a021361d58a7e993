from __future__ import annotations

import socket

import pytest

from ckptd import durable, layout


@pytest.mark.parametrize("name, ours", [
    ("manifest-r00000.json", True), ("r00003-000012.safetensors", True), ("r00001.h5", True),
    ("r00002.writing", True), (".manifest-r00000.json~node1.cluster.local-123.tmp", True),
    (".r00000.h5~h-1.tmp", True), ("pinned", False), ("notes.txt", False), (".foo~h-1.tmp", False),
    ("manifest-r0.json", False), ("r00001-1.safetensors", False),
])
def test_which_files_are_ckptd_s(name, ours) -> None:
    assert layout.is_ckptd_file(name) is ours


def test_the_temp_name_of_a_commit_is_recognised(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-12.rack-3.example.org")
    target = tmp_path / "manifest-r00007.json"
    with durable.replacing(target) as tmp:
        assert layout.is_ckptd_file(tmp.name)  # start-up clean-up would remove a leftover
        tmp.write_bytes(b"{}")
    assert target.read_bytes() == b"{}" and not tmp.exists()


# -- the package's layout (scripts/layout_figures.py; docs/design.md "Layers") -----------

def _figures_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "layout_figures.py"
    spec = importlib.util.spec_from_file_location("layout_figures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def figures():
    from pathlib import Path

    return _figures_module().figures(Path(__file__).resolve().parent.parent)


def test_no_import_cycle_with_the_imports_inside_functions(figures) -> None:
    assert figures["cycles"] == [] and figures["cycles_module_level"] == []


def test_no_cycle_even_through_annotations_and_no_package_cycle(figures) -> None:
    assert figures["cycles_type_checking"] == [] and figures["package_cycles"] == []


def test_no_two_modules_share_a_name(figures) -> None:
    assert figures["repeated_module_names"] == []


def test_the_house_stays_within_its_limits(figures) -> None:
    """The limits docs/design.md gives the package: a reader that never asks a tier what it
    can do, a daemon of a few parts, short modules and functions, comments that say why."""
    assert figures["reader_asks_tiers"] == [] and figures["tier_modules_over_300"] == []
    assert len(figures["daemon_attributes"]) <= 12, figures["daemon_attributes"]
    assert figures["reader_load_lines"] <= 40 and figures["functions_over_60"] == []
    assert figures["comments_per_1000"] <= 25 and figures["median_docstring_lines"] <= 8
    assert figures["docs"]["pages"] <= 12 and figures["docs"]["kb"] <= 150


def test_no_format_module_imports_the_daemon(figures) -> None:
    # annotation-only imports count too: the format protocol takes plain values
    assert figures["format_imports_daemon"] == []


def test_no_tier_is_named_in_a_branch_outside_the_tiers(figures) -> None:
    assert figures["tier_branches"] == []


def test_the_figures_see_what_they_forbid(tmp_path) -> None:
    """Each rule above fails on a package that breaks it: a cycle through an import
    inside a function, a format importing the daemon for an annotation only, tier names
    compared and used as keys outside the tiers."""
    pkg = tmp_path / "ckptd"
    for sub in ("format", "daemon", "tiers"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from . import a\n\ndef g(t, d):\n    return t == 'peer' or d.get('remote') "
                              "or t in ('local', 'x')\n")
    (pkg / "format" / "chunk.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from ..daemon.share import Share\n")
    (pkg / "daemon" / "share.py").write_text("")
    (pkg / "tiers" / "peer.py").write_text("NAME = 'peer'\nok = NAME == 'peer'\n")
    f = _figures_module().figures(tmp_path)
    assert f["cycles"] == [["ckptd.a", "ckptd.b"]] and f["cycles_module_level"] == []
    assert f["format_imports_daemon"] == ["ckptd.format.chunk imports ckptd.daemon.share"]
    assert f["tier_branches"] == ["ckptd.b:4"]  # one line, three branches; none in tiers/
    assert ["ckptd.daemon.share", "ckptd.format.chunk"] not in f["cycles_type_checking"]
    (pkg / "daemon" / "share.py").write_text("from ..format import chunk\n")
    (pkg / "tiers" / "chunk.py").write_text("")
    f = _figures_module().figures(tmp_path)
    assert ["ckptd.daemon.share", "ckptd.format.chunk"] in f["cycles_type_checking"]
    assert f["cycles_module_level"] == [] and ["ckptd.daemon", "ckptd.format"] in f["package_cycles"]
    assert f["repeated_module_names"] == ["chunk.py: ckptd.format.chunk, ckptd.tiers.chunk"]
