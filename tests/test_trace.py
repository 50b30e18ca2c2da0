"""Interval arithmetic behind compute / exposed-communication / idle, against brute force."""

import random

import pytest

from zsim.step.trace import uncovered, union_length


def brute(intervals, cover, step=0.001):
    ts = [i * step + step / 2 for i in range(int(10 / step))]
    inside = lambda t, xs: any(a <= t < b for a, b in xs)  # noqa: E731
    return sum(step for t in ts if inside(t, intervals) and not inside(t, cover))


@pytest.mark.parametrize("seed", range(5))
def test_uncovered_matches_brute_force(seed):
    rng = random.Random(seed)
    spans = [(a, a + rng.uniform(0, 1)) for a in (rng.uniform(0, 9) for _ in range(12))]
    cover = [(a, a + rng.uniform(0, 2)) for a in (rng.uniform(0, 8) for _ in range(8))]
    assert uncovered(spans, cover) == pytest.approx(brute(spans, cover), abs=0.02)
    assert union_length(spans) == pytest.approx(brute(spans, []), abs=0.02)
