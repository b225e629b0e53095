"""The broker loop's turn figures: what `tierkv bench engines` reads to say whether
the broker is ever the reason an engine's step waits."""

from broker.turns import Turns


def test_the_longest_and_the_total_since_start():
    w = Turns()
    w.record(100.002, 0.002)
    w.record(100.505, 0.005)
    w.record(101.001, 0.001)
    stats = w.stats(101.5)
    assert stats["count"] == 3
    assert abs(stats["busy_s"] - 0.008) < 1e-9
    assert stats["longest_ms"] == 5.0
    assert stats["recent_longest_ms"] == 5.0


def test_a_turn_counts_its_cpu_time_not_the_wall_time_it_spanned():
    w = Turns()
    w.record(100.5, 0.002)  # begun at 100.0, descheduled most of the half second
    assert w.stats(100.6)["longest_ms"] == 2.0


def test_a_long_one_from_long_ago_leaves_the_recent_longest():
    w = Turns(recent_s=10)
    w.record(100.5, 0.5)  # start-up, say
    for second in range(101, 130):
        w.record(second + 0.001, 0.001)
    stats = w.stats(129.5)
    assert stats["longest_ms"] == 500.0  # kept since start
    assert stats["recent_longest_ms"] == 1.0  # not among the last 10 s


def test_nothing_recent_reads_zero():
    w = Turns(recent_s=5)
    w.record(10.003, 0.003)
    assert w.recent_longest(100.0) == 0.0
    assert Turns().stats(0.0)["recent_longest_ms"] == 0.0
