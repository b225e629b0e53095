"""Config: defaults work; every kind of mistake is one clear error naming key and file."""

from __future__ import annotations

import tomllib

import pytest

from tierkv.node.config import ConfigError, config_from_dict, dump_config, load_config


def write(tmp_path, text: str):
    path = tmp_path / "tierkv.toml"
    path.write_text(text)
    return path


def test_defaults_make_a_single_node():
    config = load_config(None)
    assert config.cpu.num_blocks > 0 and config.tiers == []
    assert config.address("client").startswith("ipc://")
    assert str(config.run_path).endswith(f"tierkv/{config.instance}")


def test_file_values_and_round_trip(tmp_path):
    path = write(tmp_path, """
        instance = "n1"
        [cpu]
        num_blocks = 8
        page_size = 4096
        policy = "arc"
        [broker]
        job_timeout_s = 3
        [[tiers]]
        type = "memory"
        capacity_blocks = 10
    """.replace("\n        ", "\n"))
    config = load_config(path)
    assert config.cpu.policy == "arc" and config.broker.job_timeout_s == 3.0
    assert config.tier_names == ["memory"]
    again = config_from_dict(tomllib.loads(dump_config(config)))
    assert again == config


@pytest.mark.parametrize("text, match", [
    ("instanse = 'x'\n", r"unknown key instanse"),
    ("[cpu]\nnum_blcks = 3\n", r"unknown key cpu.num_blcks"),
    ("[cpu]\nnum_blocks = 'many'\n", r"cpu.num_blocks must be int, got str"),
    ("[cpu]\nnum_blocks = 0\n", r"cpu.num_blocks must be positive"),
    ("[cpu]\npolicy = 'fifo'\n", r"cpu.policy is 'fifo'; known: .*lru"),
    ("[cpu]\nnum_blocks = 100000000\npage_size = 1048576\n", r"more than this machine has"),
    ("cpu = 3\n", r"\[cpu\] must be a table"),
    ("[[tiers]]\nroot = '/x'\n", r"tiers\[0\] has no 'type'"),
    ("[[tiers]]\ntype = 'memory'\n[[tiers]]\ntype = 'memory'\n", r"'memory' is used twice"),
    ("[[tiers]]\ntype = 'memory'\nprocesses = -1\n", r"tiers\[0\].processes must be"),
    ("[broker]\nheartbeat_s = -1\n", r"broker.heartbeat_s must be positive"),
    ("[worker]\ndevice = 'tpu'\n", r"worker.device must be auto, cpu or cuda"),
    ("log_level = 'loud'\n", r"log_level must be"),
    ("[supervisor]\nbroker_probe_misses = 0\n", r"supervisor.broker_probe_misses must be >= 1"),
    ("this is not toml", r"not valid TOML"),
    ("[supervisor]\nlog_file_count = 1\n", r"supervisor.log_file_count must be >= 2"),
    ("[supervisor]\nlog_file_bytes = 100\n", r"supervisor.log_file_bytes must be >= 4096"),
])
def test_mistakes_name_the_key_and_the_file(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "\n" not in str(e.value)  # one line


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
