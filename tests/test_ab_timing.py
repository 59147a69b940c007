"""CPU checks of the interleaved A/B timing used by scripts/gpu_check_*.py --rounds."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import ab_timing  # noqa: E402


class FakeClock:
    """A clock that each call of variant `name` advances by cost[name]."""

    def __init__(self, cost):
        self.now, self.cost, self.log = 0.0, cost, []

    def __call__(self):
        return self.now

    def call(self, name):
        def f():
            self.log.append(name)
            self.now += self.cost[name]
            return name
        return f


def test_rounds_alternate_the_order_and_time_each_call():
    clock = FakeClock({"a": 2.0, "b": 1.0, "c": 4.0})
    calls = {n: clock.call(n) for n in "abc"}
    synced = []
    times = ab_timing.interleaved(calls, synced.append, rounds=3, inner=2, warmup=1,
                                  clock=clock)
    assert times == {"a": [2.0] * 3, "b": [1.0] * 3, "c": [4.0] * 3}
    # warm-up a b c, an untimed round, then rounds a b c | c b a | a b c, two
    # calls each
    assert "".join(clock.log) == "abc" + "aabbcc" + "aabbcc" + "ccbbaa" + "aabbcc"
    # one sync per warm-up call, then one per round and variant, on the last
    # call's outputs only
    assert synced == list("abc") + list("abc") + list("abc") + list("cba") + list("abc")


def test_settle_runs_the_variant_untimed_before_each_timed_burst():
    """settle (Note [Clock settling]): before each timed burst, bursts of `inner`
    calls of the same variant run until `settle` seconds have passed; they are not
    in the timings, and the order of the rounds is unchanged."""
    clock = FakeClock({"a": 2.0, "b": 1.0})
    calls = {n: clock.call(n) for n in "ab"}
    synced = []
    times = ab_timing.interleaved(calls, synced.append, rounds=2, inner=2, warmup=1,
                                  clock=clock, settle=5.0)
    assert times == {"a": [2.0] * 2, "b": [1.0] * 2}
    # a: bursts of 4 s, so two settle bursts (8 s >= 5) then the timed one;
    # b: bursts of 2 s, three settle bursts (6 s >= 5) then the timed one.
    a_round, b_round = "aa" * 3, "bb" * 4
    assert "".join(clock.log) == "ab" + "aabb" + a_round + b_round + b_round + a_round
    # one sync per burst, timed or not
    assert synced == list("ab") + list("ab") + list("aaabbbb") + list("bbbbaaa")


def test_summary_reports_median_spread_and_ratio():
    times = {"default": [1.0, 1.1, 1.0], "faster": [0.5, 0.5, 0.55], "same": [1.02, 1.0, 0.99]}
    lines = ab_timing.summary(times, flops=2e12)
    assert lines[0].split()[1] == "2.0"  # 2e12 FLOP in a 1 s median: 2 TF/s
    assert "x first 2.000" in lines[1] and "(noise)" not in lines[1]
    assert "range 10.0%" in lines[0]
    assert "(noise)" in lines[2]  # 0.98x, inside the first variant's 10% range


def test_rejects_empty_rounds():
    with pytest.raises(ValueError):
        ab_timing.interleaved({"a": lambda: 0}, lambda _: None, rounds=0)


def test_gpu_check_bwd_rounds_glue_on_the_cpu(monkeypatch):
    """gpu_check_bwd.timing_interleaved with a stand-in kernel call: every variant
    gets its own padded workspaces (80-row tiles: Sq_pad 4224) and a summary row."""
    pytest.importorskip("cutlass")
    import gpu_check_bwd as g
    import jax.numpy as jnp

    seen = []

    def make_kcall(dtype, d, causal, scale, variant):
        def kcall(q, k, v, do, lse, dpsum, dq_accum):
            seen.append((variant, causal, lse.shape[-1], dq_accum.shape[2]))
            return dq_accum, k, v
        return kcall

    monkeypatch.setattr(g.jax.random, "normal",
                        lambda key, shape, dtype=jnp.float32: jnp.ones(shape, dtype))
    rows = []
    g.timing_interleaved(make_kcall, rows, ["default", "m80", "default"], (128,), rounds=2)
    assert {(v, c, a, b) for v, c, a, b in seen} == {
        ("default", False, 4096, 4096), ("m80", False, 4224, 4224),
        ("default", True, 4096, 4096), ("m80", True, 4224, 4224)}
    assert [r[0] for r in rows] == ["ab d128 c0 x2"] * 2 + ["ab d128 c1 x2"] * 2
