"""The README and the docs are what a new user runs first: their examples run as
written, and what they say about the commands and the report is what they do."""

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
RUNNING = (REPO / "docs" / "running.md").read_text()  # the node: config, S3, status, demo
CLIENT = (REPO / "docs" / "client.md").read_text()  # the engine API


def blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def section(title: str, text: str = README) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end != -1 else None]


def run_example(marker: str, tmp_path: Path, instance: str, text: str = README) -> None:
    """Run the python example of `text` that contains `marker` against a real node;
    each line commented with a result (`# Lookup(...)`) must return it."""
    (code,) = [b for b in blocks("python", text) if marker in b]
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
    run_example("SharedRegion.attach", tmp_path, instance, CLIENT)


def test_the_s3_example_works_as_written(tmp_path, monkeypatch):
    """The credentials line, the local endpoint command and the s3 entry, as
    docs/running.md gives them (only the port is another, free one): the endpoint admits the
    key pair the shell line makes, and the tier, reading the same variables, works."""
    from tierkv.tiers.registry import create_backend

    running = section("### An S3 tier, and the local endpoint", RUNNING)
    (exports,) = re.findall(r"^(export .+?)\s+#", running, flags=re.M)
    shell = subprocess.run(["bash", "-c", f"{exports}\nenv -0"], capture_output=True,
                           timeout=30, check=True)
    made = dict(v.split("=", 1) for v in shell.stdout.decode().split("\0") if "=" in v)
    names = re.findall(r"(\w+)=", exports)
    for name in names:
        monkeypatch.setenv(name, made[name])
    assert len(made[names[1]]) >= 16  # a secret no other user can guess
    (command,) = re.findall(r"^python -m tierkv\.s3server (.+?)\s*&", running, flags=re.M | re.S)
    words = command.replace("\\\n", " ").split()
    port = words[words.index("--port") + 1]
    words[words.index("--port") + 1] = "0"  # any free port; it says which in its ready line
    (toml,) = [b for b in blocks("toml", running) if 'type = "s3"' in b]
    (entry,) = [t for t in tomllib.loads(toml)["tiers"] if t["type"] == "s3"]
    server = spawn("readme-s3", [sys.executable, "-m", "tierkv.s3server", *words],
                   env=child_environment())
    try:
        wait_ready([server], 30)
        bound = int(server.ready_detail.split()[-1])
        assert entry["endpoint_url"] == f"http://127.0.0.1:{port}"
        entry["endpoint_url"] = f"http://127.0.0.1:{bound}"
        _wait_http(bound)
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
            conn.request("GET", "/")  # refused unsigned: an answer all the same
            conn.getresponse().read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            conn.close()


def test_every_config_in_the_readme_is_valid():
    """The README's configs and every document's: each key shown is one `tierkv config`
    accepts."""
    for document in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        configs = blocks("toml", document.read_text())
        assert configs or document.name != "README.md"
        for text in configs:
            config_from_dict(tomllib.loads(text), str(document.relative_to(REPO)))


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
    explained = section("### The demo's report", RUNNING)
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
    explained = section("### `tierkv status`", RUNNING)
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


# What the documents send a reader to: relative links, backticked `*.md` paths, and any
# other name of a document (a web address aside).
LINK = re.compile(r"\]\(([^)\s]+)\)")
BACKTICKED_DOCUMENT = re.compile(r"`([^`\s]+\.md)`")
WEB_ADDRESS = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
DOCUMENT_NAME = re.compile(r"[\w.-]+\.md\b")
ELSEWHERE = re.compile(r"\b(?:DESIGN|CONVENTIONS)\.md\b")  # a steering repository's, once


def documents() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def unresolved(document: Path, text: str, names: set[str]) -> list[str]:
    """What `document` points a reader at that is not in this repository."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    bad = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):
            continue  # a web address, or a place on this page
        path = target.split("#")[0]
        if not (REPO / path[1:] if path.startswith("/") else document.parent / path).exists():
            bad.append(f"link {target}")
    for path in BACKTICKED_DOCUMENT.findall(prose):
        if not ((REPO / path).is_file() or (document.parent / path).is_file()):
            bad.append(f"`{path}`")
    named = set(DOCUMENT_NAME.findall(WEB_ADDRESS.sub("", text))) | set(ELSEWHERE.findall(text))
    bad.extend(f"{name}: no document of that name here" for name in sorted(named - names))
    return bad


def test_every_document_the_docs_send_readers_to_is_in_the_repository():
    """A user or contributor has this repository, nothing more: a link to a document
    of another one (a `DESIGN.md`, a `CONVENTIONS.md`) leads nowhere."""
    docs = documents()
    assert all(d.is_file() for d in docs), [str(d) for d in docs if not d.is_file()]
    names = {d.name for d in docs}
    problems = {str(d.relative_to(REPO)): unresolved(d, d.read_text(), names) for d in docs}
    assert {d: p for d, p in problems.items() if p} == {}
