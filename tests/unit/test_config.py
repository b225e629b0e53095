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


DISK = "[[tiers]]\ntype = 'disk'\nroot = '/x'\nbudget_bytes = {}\n"


@pytest.mark.parametrize("text, match", [
    # 47 characters, 94 bytes of UTF-8: the shared-memory name holds 64 bytes.
    ("instance = '" + "é" * 47 + "'\n", r"instance must be 1..64 bytes of UTF-8 .*94 bytes"),
    (DISK.format(1), r"tiers\[0\].budget_bytes must hold at least one block \(266240 bytes"),
    (DISK.format(10**23), r"tiers\[0\].budget_bytes must be at most 9223372036854775807"),
    (DISK.format("1e23"), r"tiers\[0\].budget_bytes must be int, got float"),
    ("[[tiers]]\ntype = 's3'\nbucket = 'kv-cache'\nbudget_bytes = 1000\n",
     r"tiers\[0\].budget_bytes must hold at least one block \(262144 bytes"),
])
def test_what_up_would_refuse_is_refused_by_the_check(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(write(tmp_path, text))
    assert str(tmp_path) in str(e.value)


def test_a_name_that_fits_in_bytes_is_accepted(tmp_path):
    name = "é" * 32  # 64 bytes
    assert load_config(write(tmp_path, f"instance = '{name}'\n")).instance == name


def test_sizes_are_shown_in_a_unit_that_shows_them():
    from tierkv.node.config import format_bytes

    assert format_bytes(200 * 2**20) == "200.0 MiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(4096) == "4.0 KiB"
    assert format_bytes(10) == "10 bytes"


def test_down_and_status_do_not_refuse_for_start_time_reasons(tmp_path, capsys):
    from tierkv.cli import main

    # More shared memory than /dev/shm holds: `up` refuses it, but a node that is not
    # running is reported as such, rather than as a bad config.
    path = write(tmp_path, f"run_dir = '{tmp_path}/run'\n[cpu]\nnum_blocks = 100000000\n"
                 "page_size = 1048576\n")
    with pytest.raises(ConfigError, match="more than this machine has"):
        load_config(path)
    assert load_config(path, starting=False).cpu.num_blocks == 100000000
    assert main(["status", "-c", str(path), "--timeout", "0.2"]) == 1
    assert main(["down", "-c", str(path), "--timeout", "1"]) == 1
    assert "more than this machine has" not in capsys.readouterr().err
