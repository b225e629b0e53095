"""What the engine owes the broker after a round trip whose reply never came
(`tierkv.vllm.holdings`): owed again, never dropped silently, and never in a way a
repeat could do harm. Pure logic: the broker's answers are written out."""

from __future__ import annotations

from tierkv.client import Batch, RemoteError
from tierkv.vllm.holdings import Holdings


class _Calls:
    """Stands in for a `Batch`: records the calls `Owed.add_to` makes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))


def sent(holdings: Holdings) -> tuple:
    owed = holdings.take()
    calls = _Calls()
    slots = owed.add_to(calls)  # type: ignore[arg-type]
    return owed, calls.calls, slots


def test_a_lost_commit_is_sent_again_whole_and_apart_from_new_ones():
    h = Holdings()
    h.reserved(b"c1", "r", [b"k1", b"k2"])
    assert h.end_store(b"c1", "r", ok=True)
    owed, calls, _ = sent(h)
    assert calls == [("commit", [b"k1", b"k2"], True)]
    h.settle(owed, None)  # no reply: owed again
    h.reserved(b"c2", "r", [b"k3"])
    h.end_store(b"c2", "r", ok=True)
    owed, calls, slots = sent(h)
    assert calls == [("commit", [b"k1", b"k2"], True), ("commit", [b"k3"], True)]
    # While a commit is unconfirmed its keys are not reserved again (a repeat of it
    # would commit the new reservation).
    assert h.busy(b"c1", [b"k1"]) and h.busy(b"c2", [b"k3"])
    # The first try had landed: the repeat is refused, silently; both are confirmed.
    h.settle(owed, [RemoteError("not_owner", "not reserved"), None])
    assert not h.busy(b"c1", [b"k1"]) and not h.busy(b"c2", [b"k3"])
    assert slots == 2 and not h.owed


def test_only_the_job_that_reserved_a_chunk_commits_it():
    h = Holdings()
    h.reserved(b"c1", "writer", [b"k1"])
    assert not h.end_store(b"c1", "other", ok=True)
    assert h.end_store(b"c1", "writer", ok=True)


def test_a_lost_release_is_sent_again_only_if_no_other_pin_could_be_ended():
    h = Holdings()
    h.pinned([b"a"])
    h.release([b"a"])
    owed, _, _ = sent(h)
    h.settle(owed, None)  # no other pin of a: the release goes again
    assert sent(h)[1] == [("release", [b"a"])]

    h.pinned([b"b"])
    h.release([b"b"])
    owed, _, _ = sent(h)
    h.pinned([b"b"])  # another read of b, pinned since
    h.settle(owed, None)
    # A repeat could end the new pin while its row is read: the lost release is left
    # to the broker's pin deadline (and logged), the new pin is released in its turn.
    assert sent(h)[1] == []
    h.release([b"b"])
    assert sent(h)[1] == [("release", [b"b"])]


def test_shutdown_owes_an_abort_of_every_reservation_and_a_release_of_every_pin():
    h = Holdings()
    h.reserved(b"c1", "r", [b"k1"])
    h.pinned([b"p", b"p"])
    h.let_go_of_everything()
    _, calls, _ = sent(h)
    assert ("commit", [b"k1"], False) in calls
    assert ("release", [b"p", b"p"]) in calls


def test_a_batch_takes_them_first():
    """`add_to` puts them in a real batch, one result slot each."""
    h = Holdings()
    h.reserved(b"c1", "r", [b"k1"])
    h.end_store(b"c1", "r", ok=False)
    h.finish("r")
    batch = Batch(None)  # type: ignore[arg-type]  (sent by no one here)
    assert h.take().add_to(batch) == 2 == len(batch)
