"""The README is what a new user runs first: its examples run as written, and what
it says about the commands and the report is what they do (issue 13.13, 13.14)."""

from __future__ import annotations

import http.client
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.integration.cluster import make_config
from tierkv.core.policies import known_policies
from tierkv.node.config import config_from_dict, dump_config
from tierkv.node.lifecycle import child_environment, spawn, stop, wait_ready
from tierkv.node.supervisor import Node

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def section(title: str) -> str:
    start = README.index(title)
    end = README.find("\n## ", start + len(title))
    return README[start:end if end != -1 else None]


def run_example(marker: str, tmp_path: Path, instance: str) -> None:
    """Run the README's python example that contains `marker` against a real node;
    each line commented with a result (`# Lookup(...)`) must return it."""
    (code,) = [b for b in blocks("python") if marker in b]
    config = make_config(instance, tmp_path / "run", cpu={"num_blocks": 16, "page_size": 32768},
                         tiers=[])
    path = tmp_path / "node.toml"
    path.write_text(dump_config(config))
    checked = 0
    lines = []
    for line in code.replace('"mynode"', repr(instance)).replace('"node.toml"',
                                                                repr(str(path))).splitlines():
        said = re.fullmatch(r"(\s*)(.+?)\s+# (\w+\(.*\))", line)
        if said:
            indent, expr, result = said.groups()
            line = f"{indent}assert repr({expr}) == {result!r}, repr({expr})"
            checked += 1
        lines.append(line)
    assert checked >= 1
    with Node(config):
        scope: dict = {}
        try:
            exec(compile("\n".join(lines), "README.md", "exec"), scope)  # noqa: S102
        finally:
            if "c" in scope:
                scope["c"].close()


def test_the_engine_example_runs_and_prints_what_its_comments_say(tmp_path, instance):
    run_example("allocate_kv_cache", tmp_path, instance)


def test_the_engine_copy_example_runs_as_written(tmp_path, instance):
    """Protocol v2's worked example: reserve, write the rows, commit, pin, read."""
    run_example("SharedRegion.attach", tmp_path, instance)


def test_the_s3_example_works_as_written(tmp_path, monkeypatch):
    """The local endpoint command, the credentials line and the s3 entry, as the
    README gives them (only the port is another, free one)."""
    from tierkv.tiers.registry import create_backend

    (command,) = re.findall(r"^(python -m tierkv\.s3server --port (\d+))", README, flags=re.M)
    (exports,) = re.findall(r"^export (.+?)\s+#", README, flags=re.M)
    for pair in exports.split():
        name, value = pair.split("=")
        monkeypatch.setenv(name, value)
    (toml,) = [b for b in blocks("toml") if 'type = "s3"' in b]
    (entry,) = [t for t in tomllib.loads(toml)["tiers"] if t["type"] == "s3"]
    argv = [sys.executable, *command[0].split()[1:]]
    argv[-1] = "0"  # any free port; it says which in its ready line
    server = spawn("readme-s3", argv, env=child_environment())
    try:
        wait_ready([server], 30)
        port = int(server.ready_detail.split()[-1])
        assert entry["endpoint_url"] == f"http://127.0.0.1:{command[1]}"
        entry["endpoint_url"] = f"http://127.0.0.1:{port}"
        _wait_http(port)
        backend = create_backend(entry, block_bytes=4096, namespace="readme", name="s3")
        try:
            block = bytes(range(256)) * 16
            backend.store(b"k1", memoryview(block))
            back = bytearray(4096)
            backend.load(b"k1", memoryview(back))
            assert bytes(back) == block
        finally:
            backend.close()
    finally:
        stop(server, 5)


def _wait_http(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        try:
            conn.request("GET", "/moto-api/data.json")
            conn.getresponse().read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            conn.close()


def test_every_config_in_the_readme_is_valid():
    configs = blocks("toml")
    assert configs
    for text in configs:
        config_from_dict(tomllib.loads(text), "README.md")


def test_the_readme_lists_exactly_the_policies_there_are():
    (listed,) = re.findall(r'policy = "\w+"\s+# (.+)', README)
    assert sorted(re.findall(r"\w+", listed.replace(" or ", " "))) == sorted(known_policies())


def test_the_readme_says_where_every_config_key_is_explained():
    running = section("## Running a node")
    assert "`tierkv config --explain`" in running
    assert "tierkv/node/config.py" not in running
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", "config", "--explain"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and 'type = "s3"' in out.stdout and "root" in out.stdout


def test_the_readme_explains_every_row_of_the_demo_report():
    from tierkv.demo.engine import Totals
    from tierkv.demo.report import build_report, render

    config = config_from_dict({"tiers": [{"type": "memory", "name": "disk"},
                                         {"type": "memory", "name": "s3"}]})
    t = Totals(requests=1, blocks=1)
    report = build_report(config, t, {"tiers": {"disk": {}, "s3": {}}, "cpu": {"evictions": 0}},
                          [], 1.0)
    explained = section("### The demo's report")
    labels = set()
    for line in render(report).splitlines()[1:]:
        found = re.match(r"\s*([a-z][a-z<>\-]*(?: [a-z]+)?)(?::|\s{2,}|$)", line)
        if found:
            labels.add(found.group(1))
    assert {"served from", "recomputed", "lookup", "promotion", "integrity"} <= labels
    missing = sorted(label for label in labels if f"`{label}`" not in explained)
    assert missing == []


def test_the_readme_explains_every_column_of_tierkv_status():
    from tierkv.node.status import render

    stats = {"state": "running", "uptime_s": 1.0, "pid": 1, "peers": [],
             "cpu": {"hits": 0, "misses": 0, "blocks_ready": 0, "num_blocks": 1},
             "transfers_in_flight": 0, "broker": {"transfers_failed": 0}, "tiers": {}}
    text = render({"instance": "x", "broker": stats, "supervisor": None})
    headers = [line for line in text.splitlines() if line.startswith(("process", "tier "))]
    assert len(headers) == 2
    explained = section("### `tierkv status`")
    columns = [c for header in headers for c in re.split(r"\s{2,}", header.strip())]
    assert len(columns) == 13
    assert [c for c in columns if f"`{c}`" not in explained] == []


def test_demo_output_is_ignored_by_git():
    assert "tierkv-demo/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("command", ["gc", "demo", "config", "up", "status"])
def test_every_subcommand_has_its_own_usage_and_description(command):
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", command, "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: tierkv {command}")
    description = out.stdout.split("\n\n")[1]
    assert len(description) > 20 and not description.lstrip().startswith(("-", "options"))
