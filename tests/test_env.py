"""The environment is read in one place (ckptd/env.py) with one rule for numbers."""

from __future__ import annotations

import pytest

import ckptd
from ckptd import env
from ckptd.attempt import current


def test_a_number_is_unset_a_whole_number_or_an_error_naming_the_variable() -> None:
    assert env.rank({}) is None
    assert env.rank({"RANK": ""}) is None
    assert env.rank({"RANK": "3"}) == 3
    assert env.world_size({"WORLD_SIZE": " 8 "}) == 8
    for bad in ("-1", "one", "1.0"):
        with pytest.raises(ValueError, match=r"\$LOCAL_RANK="):
            env.local_rank({"LOCAL_RANK": bad})


def test_without_a_process_group_the_rank_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (env.group_rank(), env.group_world_size()) == (2, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (env.group_rank(), env.group_world_size()) == (0, 1)


def test_a_producer_refuses_a_rank_that_is_not_a_number(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CKPTD_CONFIG", "none")
    monkeypatch.setenv("RANK", "rank0")
    with pytest.raises(ValueError, match=r"\$RANK='rank0'"):
        ckptd.Producer(endpoint=f"ipc://{tmp_path}/nobody.sock", run="t")


def test_torchrun_attempts_differ_by_restart_count_and_run_id() -> None:
    one = env.elastic({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "j", "GROUP_WORLD_SIZE": "2"})
    two = env.elastic({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "j", "GROUP_WORLD_SIZE": "2"})
    assert env.elastic({}) is None
    assert current("", 4, one) == "torchelastic:j:0"
    assert current("", 4, two) == "torchelastic:j:1"
    assert current("given-7", 4, one) == "given-7"


def test_a_service_manager_is_known_by_the_invocation_id_it_sets() -> None:
    assert env.under_systemd({"INVOCATION_ID": "0f3c9a"}) and not env.under_systemd({})
    assert not env.under_systemd({"INVOCATION_ID": ""})
