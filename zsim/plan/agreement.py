"""How alike the planner's two tiers order the same layouts."""

from __future__ import annotations


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists without ties: how alike the two tiers order
    the same layouts."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks
