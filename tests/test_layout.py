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
