"""The hit-density policy: what it learns, how it uses hints, and that it stays safe."""

from __future__ import annotations

import numpy as np
import pytest

from tierkv.bench.replay import HintMode, replay
from tierkv.core.policies import RequestHints
from tierkv.core.policies.density import (
    _HI,
    _LO,
    _MID,
    NBINS,
    HitDensityPolicy,
    age_bin,
    age_bins,
    densities,
    distinct_densities,
)
from tierkv.core.primary import PrimaryTier
from tierkv.workloads.synthetic import generate_workload
from tierkv.workloads.traces import Request, prefix_hit_ratio, serve_request


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_age_bins_match_the_scalar_bins():
    ages = np.array([*range(300), *(2**k + d for k in range(2, 40) for d in (-1, 0, 1))])
    assert list(age_bins(ages)) == [age_bin(int(a)) for a in ages]
    assert age_bin(2**60) == NBINS - 1


def test_density_ranks_returning_classes_above_the_rest():
    returns = np.zeros((3, NBINS))
    expired = np.zeros((3, NBINS))
    returns[0, age_bin(100)] = 90  # class 0: nine in ten come back at age ~100
    expired[0, age_bin(5000)] = 10
    returns[1, age_bin(100)] = 10  # class 1: one in ten
    expired[1, age_bin(5000)] = 90
    expired[2, age_bin(5000)] = 100  # class 2: never
    table = densities(returns, expired)
    young = age_bin(10)
    assert table[0, young] > table[1, young] > table[2, young] == 0.0
    # Past the return time nothing is left to expect.
    assert table[0, age_bin(1000)] < table[0, young] / 10
    # Censored samples (not back yet) say only "not back by this age": younger than
    # the return time they change nothing, older they lower the chance of a return.
    pending = np.zeros((3, NBINS))
    pending[0, age_bin(50)] = 1000
    assert densities(returns, expired, pending)[0, young] == pytest.approx(table[0, young])
    pending[0, age_bin(200)] = 1000
    assert densities(returns, expired, pending)[0, young] < table[0, young] / 2


def square_densities(returns: np.ndarray, expired: np.ndarray,
                     censored: np.ndarray) -> np.ndarray:
    """`densities` as first written: every (i, j) of the square, then masked."""
    samples = returns + expired + censored
    at_risk = samples[:, ::-1].cumsum(axis=1)[:, ::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, returns / at_risk, 0.0)
    hazard = np.clip(hazard, 0.0, 0.999)
    log_keep = np.cumsum(np.log1p(-hazard), axis=1)
    survive = np.exp(np.concatenate([np.zeros((returns.shape[0], 1)), log_keep], axis=1))
    mass = survive[:, :-1] * hazard
    q = np.cumsum(mass, axis=1)
    qm = np.cumsum(mass * _MID, axis=1)
    zero = np.zeros((returns.shape[0], 1))
    q0 = np.concatenate([zero, q[:, :-1]], axis=1)
    qm0 = np.concatenate([zero, qm[:, :-1]], axis=1)
    hits = q[:, None, :] - q0[:, :, None]
    lo = _LO[None, :, None]
    occupancy = (qm[:, None, :] - qm0[:, :, None]) - lo * hits + (
        survive[:, None, 1:] * (_HI[None, None, :] - lo))
    upper = np.triu(np.ones((NBINS, NBINS), dtype=bool))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(upper[None] & (occupancy > 0), hits / occupancy, 0.0)
    return ratio.max(axis=2)


def test_the_tables_are_the_same_bits_as_the_full_square():
    """The triangle and the once-per-distinct-class computations change no bit of
    a table (a different bit could change a victim)."""
    rng = np.random.default_rng(11)
    for trial in range(60):
        n = int(rng.integers(1, 21))
        arrays = [rng.random((n, NBINS)) * float(rng.integers(1, 1000))
                  * (rng.random((n, NBINS)) < rng.random()) for _ in range(3)]
        same = rng.random(n) < 0.6  # classes with the same samples (as empty ones are)
        for a in arrays:
            a[same] = a[0]
        if trial % 4 == 0:
            arrays[0][same] = 0.0  # nothing came back: density 0 everywhere
        expected = square_densities(*arrays).tobytes()
        assert densities(*arrays).tobytes() == expected
        assert distinct_densities(*arrays).tobytes() == expected


def chain(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def run(tier: PrimaryTier, keys: list[bytes], req: int, hints: RequestHints | None = None,
        now: float = 0.0) -> int:
    """One request as the replay does it: note, lookup, load, store, finish."""
    return serve_request(tier, keys, req, hints, now)


def test_a_shared_prompt_survives_finished_sessions():
    """Sessions that share a system prompt end (continues=False); their private
    blocks go, the prompt stays: one session's hint never evicts a shared prefix."""
    cap = 64
    tier = PrimaryTier(cap, HitDensityPolicy(cap), enable_events=False)
    system = [1, 2, 3]
    for s in range(400):
        private = [1000 + 10 * s + i for i in range(6)]
        hints = RequestHints(session=s, turn=0, continues=False)
        run(tier, chain(*system, *private), s, hints, now=float(s))
        tier.check_invariants()
    assert all(tier.is_ready(k) for k in chain(*system))
    assert tier.stats()["evictions"] > 0


def test_continuing_sessions_are_kept_over_finished_ones():
    """Half the sessions say they continue, half that they end; under pressure the
    continuing ones come back to a hit far more often than without the hint."""
    def trace() -> list[tuple[list[bytes], RequestHints]]:
        out = []
        for s in range(300):
            first = chain(*[10_000 * (s + 1) + i for i in range(8)])
            cont = s % 2 == 0
            out.append((first, RequestHints(session=s, turn=0, continues=cont)))
            if s >= 20 and (s - 20) % 2 == 0:  # the continuing session of 20 requests ago
                back = chain(*[10_000 * (s - 19) + i for i in range(8)]) + [key(7 * s + 3)]
                out.append((back, RequestHints(session=s - 20, turn=1, continues=False)))
        return out

    def hits(with_hints: bool) -> int:
        cap = 96
        tier = PrimaryTier(cap, HitDensityPolicy(cap), enable_events=False)
        return sum(run(tier, keys, i, hints if with_hints else None, float(i))
                   for i, (keys, hints) in enumerate(trace()))

    assert hits(True) > 1.5 * hits(False)


def test_queued_requests_keep_what_they_will_hit():
    cap = 16
    policy = HitDensityPolicy(cap)
    tier = PrimaryTier(cap, policy, enable_events=False)
    run(tier, chain(1, 2, 3, 4), 0)
    run(tier, chain(51, 52), 1)
    # Queued: one request will hit 1 2 3 4; another misses at 50, so the cached
    # 51 52 are no use to it. The tier's prefetch candidates: 5, then 50.
    queued = [chain(1, 2, 3, 4, 5), chain(50, 51, 52)]
    assert tier.note_queue(queued, now=1.0) == [key(5), key(50)]
    assert policy.stats()["queued"] == 4
    # Flood the tier with one-off requests: 1 2 3 4 stay, 51 52 go.
    for i in range(40):
        tier.note_queue(queued, now=2.0 + i)
        run(tier, chain(*(1000 + 5 * i + j for j in range(3))), 10 + i)
        tier.check_invariants()
    assert all(tier.is_ready(k) for k in chain(1, 2, 3, 4))
    assert not tier.is_ready(key(51))


def test_a_queue_that_lies_stops_being_trusted():
    cap = 32
    policy = HitDensityPolicy(cap)
    tier = PrimaryTier(cap, policy, enable_events=False)
    for i in range(600):
        keys = chain(*(100 * i + j for j in range(4)))
        # The "queue" names cached blocks of a request that never comes again.
        tier.note_queue([chain(*(100 * (i - 1) + j for j in range(4)))] if i else [],
                        float(i))
        run(tier, keys, i, now=float(i))
    assert policy.queue_trust < 0.25
    assert policy.stats()["queued"] == 0


@pytest.mark.parametrize("name", ["chat", "docs", "scan", "agent", "longdoc"])
def test_beats_lru_without_hints_on_synthetic_workloads(name):
    trace = generate_workload(name, 1500, seed=11)
    for capacity in (300, 1200):
        ours = replay(trace, capacity, "hitdensity")
        lru = replay(trace, capacity, "lru")
        assert ours.hit_blocks >= lru.hit_blocks, (name, capacity)


def test_wrong_hints_cost_little_and_right_ones_help():
    trace = generate_workload("chat", 2000, seed=4)
    capacity = 800
    plain = replay(trace, capacity, "hitdensity").hit_ratio
    right = replay(trace, capacity, "hitdensity", hints=HintMode(True, 0.0)).hit_ratio
    wrong = replay(trace, capacity, "hitdensity", hints=HintMode(True, 1.0)).hit_ratio
    noise = replay(trace, capacity, "hitdensity", hints=HintMode(True, 0.5)).hit_ratio
    assert right > 1.05 * plain
    # Always wrong is learned as the opposite signal; a coin toss is noise that
    # splits the samples between two classes: a few percent at most.
    assert wrong >= 0.97 * plain and noise >= 0.95 * plain


def test_ghosts_stay_within_the_history():
    policy = HitDensityPolicy(100, history=2.0)
    policy.ghost_limit = 500  # below the 65,536 floor, to see it act
    empty: frozenset[bytes] = frozenset()
    for i in range(5000):
        if len(policy) == 100:
            assert policy.evict(1, empty) is not None
        policy.insert(key(i), i)
        if i % 7 == 0:
            policy.touch([key(i // 2)])
    assert policy.ghosts <= 500 and len(policy) == 100
    assert len(policy._rec) == len(policy) + policy.ghosts


def test_requests_without_note_request_still_learn():
    """A manager that never passes hints or chains: classes by use count."""
    trace = generate_workload("scan", 1500, seed=2)
    cap = 400
    lru = prefix_hit_ratio(trace, PrimaryTier(cap, "lru"))

    class Bare(PrimaryTier):
        def note_request(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            pass

        def note_finish(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            pass

    assert prefix_hit_ratio(trace, Bare(cap, "hitdensity")) > lru
    assert prefix_hit_ratio([Request(0.0, 1, 1, (1, 2))], Bare(cap, "hitdensity")) == 0.0


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_a_request_asked_again_is_the_same_request(name):
    """An engine looks a waiting request up at every step, and the broker tells the
    policy each time. Noting the same request again once read its own last block as
    its session's previous turn (one turn more at every ask), which changed the
    classes of its blocks and so the evictions."""
    trace = generate_workload(name, 1500, seed=1)
    cap = 400

    class AskedThrice(PrimaryTier):
        def note_request(self, req_id, keys, hints, now):  # noqa: ANN001, ANN201
            for _ in range(3):
                super().note_request(req_id, keys, hints, now)

    once = prefix_hit_ratio(trace, PrimaryTier(cap, "hitdensity"))
    assert prefix_hit_ratio(trace, AskedThrice(cap, "hitdensity")) == once


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_a_request_asked_again_about_part_of_its_chain_keeps_its_blocks(name):
    """An engine holding answers for a waiting request's first blocks looks up only
    the rest (its leading run's tail; a sliding-window scan's head). Noted as the
    whole request, that part once took the request's place: the blocks it did not
    name lost their request and their class, and were evicted sooner."""
    trace = generate_workload(name, 1500, seed=1)
    cap = 400

    class AskedAboutParts(PrimaryTier):
        def note_request(self, req_id, keys, hints, now):  # noqa: ANN001, ANN201
            super().note_request(req_id, keys, hints, now)
            half = len(keys) // 2
            super().note_request(req_id, list(keys[half:]), hints, now)
            super().note_request(req_id, list(keys[:half + 1]), hints, now)

    once = prefix_hit_ratio(trace, PrimaryTier(cap, "hitdensity"))
    assert prefix_hit_ratio(trace, AskedAboutParts(cap, "hitdensity")) == once
