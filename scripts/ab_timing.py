"""Interleaved A/B timing of kernel variants in one process (scripts/gpu_check_*.py
--rounds).

On the H200 one kernel timed twice in a row in one process read 518 and 542 TFLOP/s
(docs/performance.md, seventh session): more than most changes being measured. So
the variants are timed in rounds, A B C then C B A and so on, each round
`inner` back-to-back calls synchronised once, and each variant's median over the
rounds is compared with its own spread (METHOD.md: a difference smaller than the
spread of one version is noise).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

# Note [Clock settling]
# ~~~~~~~~~~~~~~~~~~~~~
# Under a sustained attention load the H200 sits at its 700 W power cap, and its
# SM clock depends on the kernel: 1.59-1.89 GHz in the fourteenth session's
# scripts/clock_probe.py runs (cuDNN's kernels run at 50-200 MHz more than
# jax_fa4's or flash-attn-4's at the same power). After a switch of kernel the clock
# takes time to move to the new kernel's level, so a burst of 20 calls (3-70 ms)
# partly runs at the clock the previous variant left behind. In the benchmark's
# fixed order flash-attn-4's forward follows cuDNN's backward in every other round.
# `settle` runs the variant untimed first, so each timed burst starts settled.


def interleaved(calls: Mapping[str, Callable[[], object]], sync: Callable[[object], object],
                rounds: int = 7, inner: int = 20, warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter,
                settle: float = 0.0) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per round.

    calls: name -> a function launching one step (asynchronously) and returning
    its outputs; sync(outputs) waits for the device. Rounds alternate the order
    (forward, then reversed), so that no variant always runs first or last.

    Each call's outputs are dropped when the next call is launched and only the
    last call's are synchronised on, as in a training loop and in
    bench_attention.time_calls: the allocators then recycle the same buffers.
    Keeping all `inner` outputs alive instead made every round allocate fresh
    buffers; on the H200 that gave ranges of 5-25% and single rounds up to 6.5x
    slower (ninth session). One untimed round of `inner` calls per variant
    follows the `warmup` calls, so the first timed round starts from the same
    memory state as the others.

    settle > 0: before each timed burst, untimed bursts of `inner` calls of the
    same variant run until at least `settle` seconds have passed (Note [Clock
    settling]), so that the timed burst starts at the clock its own kernel holds
    under load instead of at the one the previous variant left behind.
    """
    if rounds < 1 or inner < 1:
        raise ValueError("rounds and inner must be positive")
    for f in calls.values():
        for _ in range(warmup):
            sync(f())
    names = list(calls)

    def run(f):
        out = None
        for _ in range(inner):
            out = f()
        sync(out)

    for n in names:
        run(calls[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else reversed(names):
            if settle > 0:
                t_settle = clock()
                while True:
                    run(calls[n])
                    if clock() - t_settle >= settle:
                        break
            t0 = clock()
            run(calls[n])
            times[n].append((clock() - t0) / inner)
    return times


def summary(times: Mapping[str, list[float]], flops: float) -> list[str]:
    """One line per variant: median TFLOP/s, the range over rounds as a percentage of
    the median, and the median's ratio to the first variant's. A ratio inside both
    ranges is marked as noise."""
    names = list(times)
    base = statistics.median(times[names[0]])
    base_spread = (max(times[names[0]]) - min(times[names[0]])) / base
    lines = []
    for n in names:
        ts = times[n]
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) / med
        ratio = base / med  # > 1: faster than the first variant
        noise = abs(ratio - 1) <= max(spread, base_spread)
        lines.append(f"{n:24s} {flops / med / 1e12:7.1f} TF/s  range {100 * spread:4.1f}%  "
                     f"x first {ratio:.3f}{' (noise)' if noise and n != names[0] else ''}")
    return lines


__all__ = ["interleaved", "summary"]
