from __future__ import annotations

from pathlib import Path

import pytest

from ckptd import config
from ckptd.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, value", [(0, 0), (4096, 4096), ("256MiB", 256 * 2**20), ("4GiB", 4 * 2**30),
                                         ("1.5 KB", 1500), ("10B", 10), ("7", 7)])
def test_sizes(text, value) -> None:
    assert config.parse_size(text) == value


@pytest.mark.parametrize("text, value", [(30, 30.0), (2.5, 2.5), ("30s", 30.0), ("500ms", 0.5), ("6h", 21600.0),
                                         ("2d", 172800.0), ("5m", 300.0)])
def test_durations(text, value) -> None:
    assert config.parse_duration(text) == value


@pytest.mark.parametrize("bad", ["lots", "-1", "1 parsec", True, None, -5, "1e9"])
def test_bad_sizes(bad) -> None:
    with pytest.raises(ValueError):
        config.parse_size(bad)


def test_the_shipped_config_loads_and_matches_the_defaults() -> None:
    cfg = config.load(REPO / "config.toml")
    assert cfg.daemon == config.DaemonConfig() and cfg.producer == config.ProducerConfig()
    assert cfg.retention == config.RetentionConfig() and cfg.index == config.IndexConfig()
    assert cfg.remote == config.RemoteConfig() and not cfg.remote.enabled
    assert cfg.advise == config.AdviseConfig() and cfg.advise.mtbf is None
    assert cfg.root == REPO / "var" / "checkpoints"
    assert cfg.endpoint == f"ipc://{REPO}/var/run/ckptd.sock"


def test_every_key_is_documented_in_the_shipped_config() -> None:
    text = (REPO / "config.toml").read_text()
    for cls in (config.DaemonConfig, config.ProducerConfig, config.RetentionConfig, config.IndexConfig,
                config.RemoteConfig, config.AdviseConfig):
        for f in cls.__dataclass_fields__:
            assert f"\n{f} = " in text or f"\n[remote.{f}]\n" in text, f


def test_remote_table_and_its_retention(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[remote]\nurl = "s3://bucket/some/prefix/"\npart_bytes = "8MiB"\n'
                 '[remote.retention]\nkeep_last = 20\n[retention]\nkeep_last = 3\n')
    cfg = config.load(f)
    assert cfg.remote.url == "s3://bucket/some/prefix" and cfg.remote.part_bytes == 8 * 2**20
    assert cfg.remote.retention.keep_last == 20 and cfg.retention.keep_last == 3
    f.write_text('[remote.retention]\nkeep_lots = 1\n')
    with pytest.raises(ConfigError, match=r"unknown key 'keep_lots' in \[remote.retention\]"):
        config.load(f)
    f.write_text('[remote]\nretention = 3\n')
    with pytest.raises(ConfigError, match=r"must be a table: write it as \[remote.retention\]"):
        config.load(f)
    f.write_text('[remote]\nurl = "bucket"\n')
    with pytest.raises(ConfigError, match=r"bad value for 'url' in \[remote\].*not a URL"):
        config.load(f)


def test_unknown_key_names_key_and_file(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[daemon]\nchunksize = 5\n")
    with pytest.raises(ConfigError, match=rf"unknown key 'chunksize' in \[daemon\] of {f}"):
        config.load(f)
    f.write_text("[deamon]\n")
    with pytest.raises(ConfigError, match=r"unknown table \[deamon\]"):
        config.load(f)


@pytest.mark.parametrize("line, key", [('chunk_size = "huge"', "chunk_size"), ('format = "zip"', "format"),
                                       ("fsync = 1", "fsync"), ('log_level = "loud"', "log_level"),
                                       ("memory_budget = 0", "memory_budget"), ('nice = "lowest"', "nice"),
                                       ("nice = 20", "nice")])
def test_bad_value_names_key_and_file(tmp_path, line, key) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f"[daemon]\n{line}\n")
    with pytest.raises(ConfigError, match=rf"bad value for '{key}' in \[daemon\] of {f}"):
        config.load(f)


@pytest.mark.parametrize("line, value", [("nice = 0", 0), ("nice = 19", 19), ('nice = "idle"', "idle"),
                                         ('nice = " IDLE "', "idle")])
def test_nice_is_a_niceness_or_idle(tmp_path, line, value) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f"[daemon]\n{line}\n")
    assert config.load(f).daemon.nice == value


def test_not_toml_and_missing_file(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[daemon\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(f)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml")


def test_relative_paths_resolve_against_the_file(tmp_path, monkeypatch) -> None:
    f = tmp_path / "sub" / "c.toml"
    f.parent.mkdir()
    f.write_text('[daemon]\nroot = "ck"\nendpoint = "ipc://r/d.sock"\n')
    monkeypatch.setenv("CKPTD_CONFIG", str(f))
    cfg = config.load()
    assert cfg.root == tmp_path / "sub" / "ck" and cfg.endpoint == f"ipc://{tmp_path}/sub/r/d.sock"
    assert config.default_root() == tmp_path / "sub" / "ck"
    monkeypatch.setenv("CKPTD_ROOT", "/elsewhere")
    assert str(config.default_root()) == "/elsewhere"


def test_every_peer_key_is_in_the_shipped_config_commented_out() -> None:
    text = (REPO / "config.toml").read_text()
    for f in config.PeerConfig.__dataclass_fields__:
        assert f"\n# {f} = " in text, f
    assert config.load(REPO / "config.toml").peer == config.PeerConfig()  # commented out: no peer tier


def test_the_peer_placement_rate_and_plaintext_keys(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[peer]\nlisten = "tcp://10.0.0.5:7701"\nrate = "1GiB"\nallow_plaintext = true\n'
                 'placement = "rendezvous"\ndomain = 4\ncurve_peers = "peers"\n')
    p = config.load(f).peer
    assert (p.rate, p.allow_plaintext, p.placement, p.domain, p.curve_peers) == (2**30, True, "rendezvous", 4, "peers")
    assert config.PeerConfig().placement == "ring" and config.PeerConfig().rate == 0
    f.write_text('[peer]\nplacement = "random"\n')
    with pytest.raises(ConfigError, match=r"placement"):
        config.load(f)
    f.write_text('[peer]\nallow_plaintext = "yes"\n')
    with pytest.raises(ConfigError, match=r"allow_plaintext"):
        config.load(f)


# -- which file: config.discover ---------------------------------------------------------------
def test_a_training_projects_own_config_toml_is_passed_over(tmp_path, monkeypatch) -> None:
    """A job run from its own folder, whose config.toml is its own, reads ckptd's config
    (here the user's) and says which file it passed over, instead of "unknown table"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTD_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "config.toml").write_text('[model]\nwidth = 512\n[daemon]\nroot = "mine"\n')
    user = tmp_path / "xdg/ckptd/config.toml"
    user.parent.mkdir(parents=True)
    user.write_text('[daemon]\nroot = "/srv/ckpt"\n')
    cfg = config.load()
    assert cfg.path == user and cfg.root == Path("/srv/ckpt")
    assert f"{tmp_path / 'config.toml'} passed over: [model] is not a ckptd table" in cfg.origin
    user.unlink()
    cfg = config.load()
    assert cfg.path is None and "passed over" in cfg.origin and "built-in defaults" in cfg.origin
    (tmp_path / "config.toml").write_text('[daemon]\nroot = "mine"\n[retention]\nkeep_last = 2\n')
    assert config.load().path == tmp_path / "config.toml"  # ckptd's own tables only: ckptd's file


def test_a_producer_that_never_reached_a_daemon_fails_its_first_save_with_the_fix(tmp_path, monkeypatch) -> None:
    import torch

    from ckptd import CheckpointError, Producer

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTD_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "config.toml").write_text('[model]\nwidth = 512\n')
    with Producer(run="job", timeout=1, staging_size="1MiB") as p:  # it warns at start, in the background
        with pytest.raises(CheckpointError) as raised:
            p.save({"w": torch.ones(2)}, 1).wait(10)
    text = str(raised.value)
    assert "no ckptd daemon answered" in text and "CKPTD_CONFIG" in text and "CKPTD_ENDPOINT" in text, text
