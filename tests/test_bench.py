"""CPU checks of the benchmark (benchmarks/bench_attention.py): its JAX timing paths,
the alternating rounds, the table and where it writes."""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402


def _qkv(shape=(2, 64, 4, 32)):
    return (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(3))


@pytest.mark.parametrize("bwd_timing", ["diff", "direct"])
def test_bench_jax_times_forward_and_backward(bwd_timing):
    """Both backward timings give positive times and the fwd+bwd step's memory;
    "direct" times the pullback on saved residuals (a jitted function of the vjp
    closure), which must run as well as the whole step."""
    attn = ba.jax_impls({"xla"})["xla"]
    q, k, v = _qkv()
    t_fwd, t_bwd, mem = ba.bench_jax(attn, q, k, v, True, 2, bwd_timing)
    assert 0 < t_fwd < 10 and 0 < t_bwd < 10
    assert mem["temp_mib"] is None or (math.isfinite(mem["temp_mib"]) and mem["temp_mib"] > 0)


def test_flops_counts_causal_half_and_backward_2_5x():
    f = ba.flops(2, 4, 1024, 128, False, "fwd")
    assert f == 4 * 2 * 4 * 1024**2 * 128
    assert ba.flops(2, 4, 1024, 128, True, "fwd") == f / 2
    assert ba.flops(2, 4, 1024, 128, False, "bwd") == 2.5 * f


def test_peers_are_the_real_implementations_only():
    """jax_fa4 always; cuDNN, XLA and the deterministic backward when asked; nothing
    else."""
    assert set(ba.jax_impls(set())) == {"jax_fa4"}
    assert set(ba.jax_impls({"cudnn", "xla", "det", "fa4"})) == {
        "jax_fa4", "jax_fa4_det", "cudnn", "xla"}


def test_det_peer_is_jax_fa4_with_a_deterministic_backward(monkeypatch):
    """--peers det adds jax_fa4 with deterministic=True, and only when asked."""
    import jax_fa4

    assert "jax_fa4_det" not in ba.jax_impls({"cudnn", "xla"})
    seen = {}
    monkeypatch.setattr(jax_fa4, "attention", lambda *a, **kw: seen.update(kw) or a[0])
    ba.jax_impls({"det"})["jax_fa4_det"](1, 2, 3, True)
    assert seen == {"causal": True, "implementation": "cute", "deterministic": True}


def test_cases_option_picks_rows():
    assert ba.parse_cases("128:4096:0,256:8192:1") == [(128, 4096, False), (256, 8192, True)]
    with pytest.raises(ValueError, match="hdim:seqlen:causal"):
        ba.parse_cases("128:4096")
    with pytest.raises(ValueError, match="hdim:seqlen:causal"):
        ba.parse_cases("128:4096:yes")


class FakeClock:
    """A clock that each call of entry `name` advances by cost[name]."""

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


def test_interleaved_rounds_alternate_the_order_and_time_each_call():
    clock = FakeClock({"a": 2.0, "b": 1.0, "c": 4.0})
    calls = {n: clock.call(n) for n in "abc"}
    synced = []
    times = ba.interleaved(calls, synced.append, rounds=3, inner=2, warmup=1, clock=clock)
    assert times == {"a": [2.0] * 3, "b": [1.0] * 3, "c": [4.0] * 3}
    # warm-up a b c, an untimed round, then rounds a b c | c b a | a b c, two calls each
    assert "".join(clock.log) == "abc" + "aabbcc" + "aabbcc" + "ccbbaa" + "aabbcc"
    # one sync per warm-up call, then one per round and entry, on the last call's
    # outputs only
    assert synced == list("abc") + list("abc") + list("abc") + list("cba") + list("abc")
    with pytest.raises(ValueError, match="positive"):
        ba.interleaved(calls, synced.append, rounds=0)


def test_interleaved_settles_each_entry_untimed_before_its_timed_burst():
    """settle (Note [Clock settling]): before each timed burst, bursts of `inner` calls
    of the same entry run until `settle` seconds have passed; they are not in the
    timings, and the order of the rounds is unchanged."""
    clock = FakeClock({"a": 2.0, "b": 1.0})
    calls = {n: clock.call(n) for n in "ab"}
    synced = []
    times = ba.interleaved(calls, synced.append, rounds=2, inner=2, warmup=1, clock=clock,
                           settle=5.0)
    assert times == {"a": [2.0] * 2, "b": [1.0] * 2}
    # a: bursts of 4 s, so two settle bursts (8 s >= 5) then the timed one;
    # b: bursts of 2 s, three settle bursts (6 s >= 5) then the timed one.
    a_round, b_round = "aa" * 3, "bb" * 4
    assert "".join(clock.log) == "ab" + "aabb" + a_round + b_round + b_round + a_round
    assert synced == list("ab") + list("ab") + list("aaabbbb") + list("bbbbaaa")


@pytest.mark.parametrize("bwd_timing", ["diff", "direct"])
def test_rounds_time_every_implementation_interleaved(bwd_timing, monkeypatch):
    """Every implementation of a case is set up, then timed in alternating rounds;
    each gets median seconds and its range over the rounds, and the calls of
    different implementations interleave."""
    xla = ba.jax_impls({"xla"})["xla"]
    impls = {"a": xla, "b": lambda q, k, v, c: xla(q, k, v, c) * 1.0}
    q, k, v = _qkv()
    preps = {n: ba.prepare_jax(f, q, k, v, True, bwd_timing) for n, f in impls.items()}
    assert all(p.diff == (bwd_timing == "diff") for p in preps.values())
    order = []
    real = ba.interleaved

    def spy(calls, sync, **kw):
        wrapped = {n: (lambda n=n, f=f: order.append(n) or f()) for n, f in calls.items()}
        return real(wrapped, sync, **kw)

    monkeypatch.setattr(ba, "interleaved", spy)
    res = ba.measure_rounds(preps, iters=2, rounds=3)
    assert set(res) == {"a", "b"}
    for t_fwd, t_bwd, mem, r_fwd, r_bwd in res.values():
        assert 0 < t_fwd < 10 and 0 < t_bwd < 10
        assert r_fwd >= 0 and r_bwd >= 0
        assert "temp_mib" in mem
    # Warm-up (one call each), an untimed round, then rounds of iters calls per
    # (impl, direction), the order reversed every other round.
    timed = order[4 + 4 * 2:]
    blocks = [timed[j][0:2] for j in range(0, len(timed), 2)]
    assert blocks[:4] == [("a", "fwd"), ("a", "bwd"), ("b", "fwd"), ("b", "bwd")]
    assert blocks[4:8] == [("b", "bwd"), ("b", "fwd"), ("a", "bwd"), ("a", "fwd")]
    assert len(timed) == 3 * 4 * 2


def test_measure_subtracts_the_forward_for_diff_timing(monkeypatch):
    """measure(): with diff, the backward is the step minus the forward."""
    seconds = {"fwd": 0.5, "step": 2.0}
    monkeypatch.setattr(ba, "time_calls", lambda call, sync, iters, reps=5: seconds[call()])
    diff = ba.Prepared(fwd=lambda: "fwd", bwd=lambda: "step", sync=lambda _: None, mem={},
                       diff=True)
    assert ba.measure(diff, iters=1)[:2] == (0.5, 1.5)
    direct = ba.Prepared(fwd=lambda: "fwd", bwd=lambda: "step", sync=lambda _: None, mem={})
    assert ba.measure(direct, iters=1)[:2] == (0.5, 2.0)


def test_table_prints_three_decimal_ratios_and_ranges(capsys):
    """The table gives jax_fa4's ratio to each peer to 3 decimals and each timing's
    range over the rounds in %, "-" where a run had no rounds."""
    def row(impl, tf, tb, rf, rb):
        return dict(impl=impl, hdim=128, seqlen=4096, causal=False, fwd_tflops=tf,
                    bwd_tflops=tb, temp_mib=None, total_mib=None, peak_mib=None,
                    fwd_range=rf, bwd_range=rb)

    ba._print_table([row("jax_fa4", 621.0, 567.0, 0.018, 0.039),
                     row("fa4_torch", 625.0, 570.0, None, None)])
    lines = capsys.readouterr().out.splitlines()
    ours = next(x.split() for x in lines if x.split()[4:5] == ["jax_fa4"])
    peer = next(x.split() for x in lines if x.split()[4:5] == ["fa4_torch"])
    assert ours[-2:] == ["1.8", "3.9"], ours
    assert peer[-2:] == ["-", "-"], peer
    assert f"{621 / 625:.3f}" in peer and f"{567 / 570:.3f}" in peer, peer


def test_measure_rounds_passes_settle_to_the_rounds(monkeypatch):
    """--settle-ms reaches ``interleaved`` as seconds."""
    seen = {}

    def fake(calls, sync, **kw):
        seen.update(kw)
        return {n: [1.0, 2.0] for n in calls}

    monkeypatch.setattr(ba, "interleaved", fake)
    prep = ba.Prepared(fwd=lambda: 0, bwd=lambda: 0, sync=lambda _: None, mem={})
    res = ba.measure_rounds({"x": prep}, iters=3, rounds=2, settle=0.05)
    assert seen == {"rounds": 2, "inner": 3, "warmup": 1, "settle": 0.05}
    assert res["x"][:2] == (1.5, 1.5)


def test_xla_is_timed_after_the_rounds_on_its_own(monkeypatch):
    """measure_rounds: the OUTSIDE_ROUNDS peer (XLA) stays out of the alternating
    rounds (its long, low-power calls would hand the next implementation a fresh
    power budget) and is timed afterwards by ``measure``, without ranges; the others
    keep their medians and ranges."""
    seen = {}

    def fake_rounds(calls, sync, **kw):
        seen["rounds"] = sorted(calls)
        return {n: [1.0, 3.0] for n in calls}

    def fake_time_calls(call, sync, iters, reps=5):
        seen.setdefault("alone", []).append(call())
        return {"xla fwd": 7.0, "xla bwd": 9.0}[call()]

    monkeypatch.setattr(ba, "interleaved", fake_rounds)
    monkeypatch.setattr(ba, "time_calls", fake_time_calls)
    assert ba.OUTSIDE_ROUNDS == ("xla",)

    def prep(name):
        return ba.Prepared(fwd=lambda: f"{name} fwd", bwd=lambda: f"{name} bwd",
                           sync=lambda _: None, mem={"temp_mib": len(name)})

    res = ba.measure_rounds({n: prep(n) for n in ("jax_fa4", "xla", "fa4_torch")}, iters=4,
                            rounds=2)
    assert seen["rounds"] == [("fa4_torch", "bwd"), ("fa4_torch", "fwd"), ("jax_fa4", "bwd"),
                              ("jax_fa4", "fwd")]
    assert seen["alone"] == ["xla fwd", "xla bwd"]
    assert res["xla"] == (7.0, 9.0, {"temp_mib": 3})
    assert res["jax_fa4"] == (2.0, 2.0, {"temp_mib": 7}, 1.0, 1.0)
    assert set(res) == {"jax_fa4", "xla", "fa4_torch"}


def test_main_writes_only_into_its_out_folder(tmp_path, monkeypatch):
    """main(): the CSV (and the plot, where matplotlib is installed) go to --out, named
    by the date; nothing is written elsewhere, docs/ least of all. The settle option
    needs rounds."""
    with pytest.raises(SystemExit):
        ba.main(["--rounds", "1", "--settle-ms", "50", "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()
    monkeypatch.chdir(tmp_path)
    fake = {"jax_fa4": (1e-3, 2e-3, {"temp_mib": 1.0, "total_mib": 2.0}, 0.01, 0.02)}
    monkeypatch.setattr(ba, "bench_case_rounds", lambda *a: fake)
    rows = ba.main(["--cases", "64:128:1", "--peers", ""])
    assert [r["impl"] for r in rows] == ["jax_fa4"]
    assert rows[0]["fwd_tflops"] == pytest.approx(ba.flops(128, 32, 128, 64, True, "fwd") / 1e9)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
                     if p.is_file())
    assert written and all(p.startswith("bench_out/bench_attention_") for p in written), written
    assert any(p.endswith(".csv") for p in written)
    out = tmp_path / "elsewhere"
    ba.main(["--cases", "64:128:1", "--peers", "", "--out", str(out)])
    assert ".csv" in {p.suffix for p in out.iterdir()}


def test_masked_cases_count_their_visible_pairs():
    """bench_masks.py's TFLOP/s count the visible pairs of each case, by the
    reference's rule."""
    import bench_masks as bm

    cases = {c.name: c for c in bm.cases()}
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    # Causal over 8k, the second row's keys cut at 4k.
    assert bm.visible_pairs(cases["lengths"]) == tri(8192) + tri(4096) + 4096 * 4096
    # 8 documents of 1k per row, causal inside each.
    assert bm.visible_pairs(cases["packed"]) == 2 * 8 * tri(1024)
    # Bottom-right: query i of 1k sees keys j <= i + 7k.
    assert bm.visible_pairs(cases["chunk"]) == 2 * sum(7168 + i + 1 for i in range(1024))
    # Causal window (1024, 0): each query sees itself and up to 1024 keys before.
    assert bm.visible_pairs(cases["window8k"]) == 2 * sum(min(i, 1024) + 1
                                                          for i in range(8192))
    # GPT-OSS's window (128, 0); sinks add no pair.
    assert bm.visible_pairs(cases["sinks"]) == 2 * sum(min(i, 128) + 1 for i in range(8192))
    assert bm.visible_pairs(cases["softcap"]) == 2 * tri(8192)
    assert bm.visible_pairs(cases["mla"]) == 2 * tri(8192)
    # Many short causal sequences.
    assert bm.visible_pairs(cases["short32"]) == 4096 * tri(32)
    assert bm.visible_pairs(cases["short128"]) == 1024 * tri(128)
    # No mask, at lengths that are not a multiple of the counting step (1500 > 1024).
    assert bm.visible_pairs(cases["vit197"]) == 256 * 197 * 197
    assert bm.visible_pairs(cases["whisper"]) == 16 * 1500 * 1500
