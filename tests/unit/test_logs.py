"""Log lines stay bounded whatever a peer sends (13 bad messages once
wrote 54 MB of log)."""

from __future__ import annotations

import logging

from tierkv.core.loglimit import FOREIGN_CHARS, RateLimitedLog, foreign


def test_a_foreign_value_is_cut_to_a_prefix_with_its_length():
    huge = b"x" * (4 << 20)
    text = foreign(huge)
    assert len(text) < FOREIGN_CHARS + 40
    assert text.startswith("b'xxx") and f"({len(repr(huge)):,} chars)" in text
    assert foreign("short") == "short"


def test_repeated_warnings_of_one_kind_are_held_back_and_counted(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.limited"), interval_s=10.0,
                             clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="test.limited")
    for _ in range(1000):
        limited.warning(("peer-a", "malformed"), "dropped a malformed message")
    limited.warning(("peer-b", "malformed"), "dropped a malformed message")
    assert len(caplog.records) == 2  # one per key
    now[0] = 11.0
    limited.warning(("peer-a", "malformed"), "dropped a malformed message")
    assert len(caplog.records) == 3
    assert "999 more like it" in caplog.records[-1].getMessage()
    assert limited.suppressed == 999


def test_a_flood_of_new_keys_does_not_grow_the_limiter():
    limited = RateLimitedLog(logging.getLogger("test.keys"), max_keys=100)
    for i in range(10_000):
        limited.warning(("peer", i), "bad hello")
    assert len(limited._seen) == 100


def test_a_childs_long_line_is_cut_with_its_length_and_the_next_line_survives():
    import io

    from tierkv.node.logs import read_lines

    huge = b"y" * (8 << 20)
    stream = io.BufferedReader(io.BytesIO(b"first\n" + huge + b"\nafter\nlast"), 1 << 16)
    lines = list(read_lines(stream, limit=4096))
    assert lines[0] == "first" and lines[2:] == ["after", "last"]
    assert lines[1].startswith("y" * 4096) and len(lines[1]) < 4096 + 60
    assert f"[cut: the line had {len(huge):,} bytes]" in lines[1]


def test_the_node_log_rotates_and_never_takes_more_than_its_files(tmp_path):
    from tierkv.node.logs import NodeLog

    node_log = NodeLog(tmp_path / "node.log", max_bytes=64 * 1024, count=3).attach()
    try:
        line = "x" * 1000
        for i in range(2000):  # 2 MB of lines, and records of this process
            node_log.write_line(f"{i} {line}")
            if i % 100 == 0:
                logging.getLogger("test.nodelog").warning("a record of this process %d", i)
    finally:
        node_log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["node.log", "node.log.1", "node.log.2"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * (64 * 1024 + 1100)
    newest = (tmp_path / "node.log").read_text()
    assert newest.splitlines()[-1].startswith("1999 xxx")  # the newest lines are kept
    kept = "".join((tmp_path / name).read_text() for name in files)
    assert "WARNING test.nodelog: a record of this process 1900" in kept
    assert node_log.handler not in logging.getLogger().handlers
