"""Timing shared by the benchmark scripts: variants run interleaved, median per variant."""
from __future__ import annotations

import random
import statistics
import time


def interleaved_medians(variants: dict, inputs, rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant; one call of each per round, so drift on a noisy
    machine hits all variants alike, in an order shuffled each round (seeded), so no variant
    always follows the same one: in a fixed (or rotated) order mpgraph's row always ran right
    after ``.half()``'s, whose emulated fp16 kernels left the caches cold, and two identical
    copies of a Linear measured 0.95x each other there."""
    times = {k: [] for k in variants}
    order, shuffle = list(variants), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for k in order:
            t = time.perf_counter()
            variants[k](inputs)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}
