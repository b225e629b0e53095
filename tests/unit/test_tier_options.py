"""Tier entries are checked with the rest of the config, before anything starts
— each type's own options, found through the tier registry; one error
naming the key and the file; nothing imported that the check does not need (no
boto3 without an s3 tier) and nothing contacted; `tierkv config --explain` prints
every key, tier options included."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.node.config import ConfigError, check_tiers_here, load_config
from tierkv.tiers.options import REQUIRED
from tierkv.tiers.registry import (
    FRAMEWORK_ARGS,
    check_tier_entry,
    get_tier_type,
    register_tier,
    tier_options,
    unregister_tier,
)
from tierkv.tiers.registry import TierOptionError as OptionError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(f"[[tiers]]\n{tiers}\n")
    return path


@pytest.mark.parametrize("entry, match", [
    ('type = "memory"\ncapacity_blocks = "many"',
     r"tiers\[0\].capacity_blocks must be int, got str"),
    ('type = "memory"\ncapacity_blocks = 0', r"tiers\[0\].capacity_blocks must be >= 1"),
    ('type = "memory"\ncapacity = 3', r"tiers\[0\].capacity is an unknown option \(type "
                                      r"'memory' takes capacity_blocks"),
    ('type = "memory"\nthreads = true', r"tiers\[0\].threads must be int, got bool"),
    ('type = "memory"\nnegative_ttl_s = -1', r"tiers\[0\].negative_ttl_s must be >= 0"),
    ('type = "tape"', r"tiers\[0\].type is 'tape': unknown tier type 'tape'; known types: .*disk"),
    ('type = "disk"\nroot = "/x"', r"tiers\[0\].budget_bytes is required \(type 'disk'\)"),
    ('type = "disk"\nroot = "/x"\nbudget_bytes = 10\no_direct = "yes"',
     r"tiers\[0\].o_direct must be one of 'auto', true, false, got 'yes'"),
    ('type = "disk"\nroot = "/x"\nbudget_bytes = 10\nsync_per = "block"',
     r"sync_per must be one of"),
    ('type = "s3"', r"tiers\[0\].bucket is required \(type 's3'\)"),
    ('type = "s3"\nbucket = "My_Bucket"', r"tiers\[0\].bucket 'My_Bucket' is not a valid bucket"),
    ('type = "s3"\nbucket = "kvc"\nprefix = "a/../b"', r"tiers\[0\].prefix 'a/../b' must be"),
    ('type = "s3"\nbucket = "kvc"\nretry_mode = "eager"', r"retry_mode must be one of"),
    ('type = "s3"\nbucket = "kvc"\nread_timeout_s = 0', r"read_timeout_s must be positive"),
    ('type = "s3"\nbucket = "kvc"\naccess_key_id_env = "K"', r"access_key_id_env and "
                                                             r"secret_access_key_env go together"),
    ('type = "s3"\nbucket = "kvc"\naws_secret_access_key = "hunter2"',
     r"aws_secret_access_key credentials are never read from the config file"),
])
def test_a_bad_tier_entry_is_one_error_naming_the_key_and_the_file(tmp_path, entry, match):
    path = write(tmp_path, entry)
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
    assert "hunter2" not in str(e.value)


def test_good_entries_of_every_built_in_type_load():
    config = load_config(None, tiers=[
        {"type": "memory", "capacity_blocks": 8},
        {"type": "disk", "root": "/var/cache/tierkv", "budget_bytes": 10**9, "threads": 16,
         "o_direct": False},
        {"type": "s3", "bucket": "kv-cache", "endpoint_url": "http://127.0.0.1:9000",
         "create_bucket": True, "processes": 2, "read_timeout_s": 5},
    ])
    assert config.tier_names == ["memory", "disk", "s3"]


def test_checks_against_this_machine_run_only_when_asked(tmp_path):
    """`tierkv status` reads a config anywhere; the supervisor checks the machine."""
    config = load_config(None, tiers=[{"type": "disk", "root": str(tmp_path / "nope"),
                                       "budget_bytes": 10**6}])
    with pytest.raises(ConfigError, match=r"tiers\[0\].root .*nope' does not exist"):
        check_tiers_here(config)
    s3 = load_config(None, tiers=[{"type": "s3", "bucket": "kvc",
                                   "access_key_id_env": "TIERKV_TEST_UNSET_KEY",
                                   "secret_access_key_env": "TIERKV_TEST_UNSET_SECRET"}])
    with pytest.raises(ConfigError, match="TIERKV_TEST_UNSET_KEY, which is not set"):
        check_tiers_here(s3)
    check_tiers_here(load_config(None, tiers=[{"type": "disk", "root": str(tmp_path),
                                               "budget_bytes": 10**6}]))


def test_checking_tier_entries_imports_no_backend_and_no_boto3(tmp_path):
    """The broker and every process load the config: an s3 entry must not pull in
    boto3 (or the disk tier's numpy) where no backend is built."""
    path = tmp_path / "node.toml"
    path.write_text('[[tiers]]\ntype = "disk"\nroot = "/x"\nbudget_bytes = 1000000\n'
                    '[[tiers]]\ntype = "s3"\nbucket = "kv-cache"\nendpoint_url = "http://127.0.0.1:1"\n')
    code = ("import sys; from tierkv.node.config import load_config; "
            f"load_config({str(path)!r}); "
            "print(sorted(m for m in ('boto3', 'botocore', 'workers.s3.backend', "
            "'workers.disk.backend') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kind", ["memory", "disk", "s3"])
def test_a_built_in_types_options_are_its_constructors_arguments(kind):
    """The declared options and the backend's constructor cannot drift apart."""
    options = tier_options(kind)
    cls = get_tier_type(kind)
    assert cls.options is options
    params = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
              if n != "self" and n not in FRAMEWORK_ARGS}
    declared = {o.name: o.default for o in options.options}
    assert declared.keys() | options.refused.keys() == params.keys()
    for name, default in declared.items():
        if default is not REQUIRED and params[name] is not inspect.Parameter.empty:
            assert params[name] == default, name


def test_a_plug_in_without_declared_options_is_checked_by_its_signature():
    from tierkv.tiers.memory import MemoryBackend

    class Tape(MemoryBackend):
        type_name = "tape"
        options = None

        def __init__(self, reel: str, capacity_blocks: int = 4, block_bytes: int = 0) -> None:
            super().__init__(capacity_blocks, block_bytes)

    register_tier("tape", Tape)
    try:
        check_tier_entry({"type": "tape", "reel": "A"})
        with pytest.raises(OptionError, match="reel is required"):
            check_tier_entry({"type": "tape"})
        with pytest.raises(OptionError, match="spool is an unknown option"):
            check_tier_entry({"type": "tape", "reel": "A", "spool": 1})
    finally:
        unregister_tier("tape")


def test_config_explain_prints_every_key_and_every_tier_option():
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", "config", "--explain"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    from dataclasses import fields, is_dataclass

    from tierkv.node.config import Config

    text = out.stdout
    for f in fields(Config):
        if f.name in ("source", "tiers"):
            continue
        if is_dataclass(getattr(Config(), f.name)):
            assert f"[{f.name}]" in text
            for sub in fields(getattr(Config(), f.name)):
                assert f"\n{sub.name} = " in text, f"{f.name}.{sub.name}"
        else:
            assert f"\n{f.name} = " in text, f.name
    for kind in ("memory", "disk", "s3"):
        assert f'type = "{kind}"' in text
        for option in tier_options(kind).options:
            assert f"{option.name} = " in text, f"{kind}.{option.name}"
    # It is TOML, and the defaults it shows are the defaults.
    import tomllib

    from tierkv.node.config import config_from_dict

    data = tomllib.loads(text)
    tiers = data.pop("tiers")
    assert [t.get("type") for t in tiers] == [None, "disk", "memory", "s3"]
    assert config_from_dict(data) == Config()
    assert config_from_dict({"tiers": [{**tiers[0], **tiers[2]}]}).tiers[0]["threads"] == 8
