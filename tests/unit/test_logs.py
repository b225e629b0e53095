"""Log lines stay bounded whatever a peer sends (issue 20: 13 bad messages once
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
