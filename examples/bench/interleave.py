"""Timing shared by the benchmark scripts: variants run interleaved, median per variant."""
from __future__ import annotations

import statistics
import time


def interleaved_medians(variants: dict, inputs, rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant; one call of each per round, so drift on a noisy
    machine hits all variants alike."""
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            t = time.perf_counter()
            f(inputs)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}
