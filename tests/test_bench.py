"""CPU checks of the benchmark's JAX timing path (benchmarks/bench_attention.py)."""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402


@pytest.mark.parametrize("bwd_timing", ["diff", "direct"])
def test_bench_jax_times_forward_and_backward(bwd_timing):
    """Both backward timings give positive times and the fwd+bwd step's memory;
    "direct" times the pullback on saved residuals (a jitted function of the vjp
    closure), which must run as well as the whole step."""
    attn = ba.jax_impls({"xla"})["xla"]
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, 32), jnp.bfloat16)
               for i in range(3))
    t_fwd, t_bwd, mem = ba.bench_jax("xla", attn, q, k, v, True, 2, bwd_timing)
    assert 0 < t_fwd < 10 and 0 < t_bwd < 10
    assert mem["temp_mib"] is None or (math.isfinite(mem["temp_mib"]) and mem["temp_mib"] > 0)


def test_flops_counts_causal_half_and_backward_2_5x():
    f = ba.flops(2, 4, 1024, 128, False, "fwd")
    assert f == 4 * 2 * 4 * 1024**2 * 128
    assert ba.flops(2, 4, 1024, 128, True, "fwd") == f / 2
    assert ba.flops(2, 4, 1024, 128, False, "bwd") == 2.5 * f


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


@pytest.mark.parametrize("bwd_timing", ["diff", "direct"])
def test_rounds_time_every_implementation_interleaved(bwd_timing, monkeypatch):
    """--rounds: every implementation of a case is set up, then timed in alternating
    rounds; each gets median seconds and its range over the rounds, and the calls
    of different implementations interleave."""
    import ab_timing

    impls = {"a": ba.jax_impls({"xla"})["xla"],
             "b": lambda q, k, v, c: ba.jax_impls({"xla"})["xla"](q, k, v, c) * 1.0}
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, 32), jnp.bfloat16)
               for i in range(3))
    preps = {n: ba.prepare_jax(n, f, q, k, v, True, bwd_timing) for n, f in impls.items()}
    assert all(p.diff == (bwd_timing == "diff") for p in preps.values())
    order = []
    real = ab_timing.interleaved

    def spy(calls, sync, **kw):
        wrapped = {n: (lambda n=n, f=f: order.append(n) or f()) for n, f in calls.items()}
        return real(wrapped, sync, **kw)

    monkeypatch.setattr(ab_timing, "interleaved", spy)
    res = ba.measure_rounds(preps, iters=2, rounds=3)
    with pytest.raises(SystemExit):  # --settle-ms needs --rounds
        ba.main(["--settle-ms", "50", "--cases", "128:1024:0"])
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
    """--settle-ms reaches ab_timing.interleaved as seconds."""
    import ab_timing

    seen = {}

    def fake(calls, sync, **kw):
        seen.update(kw)
        return {n: [1.0, 2.0] for n in calls}

    monkeypatch.setattr(ab_timing, "interleaved", fake)
    prep = ba.Prepared(fwd=lambda: 0, bwd=lambda: 0, sync=lambda _: None, mem={})
    res = ba.measure_rounds({"x": prep}, iters=3, rounds=2, settle=0.05)
    assert seen == {"rounds": 2, "inner": 3, "warmup": 1, "settle": 0.05}
    assert res["x"][:2] == (1.5, 1.5)


def test_xla_is_timed_after_the_rounds_on_its_own(monkeypatch):
    """measure_rounds: the OUTSIDE_ROUNDS peer (XLA) stays out of the alternating
    rounds (its long, low-power calls would hand the next implementation a fresh
    power budget) and is timed afterwards by ``measure``, without ranges; the others
    keep their medians and ranges."""
    import ab_timing

    seen = {}

    def fake_rounds(calls, sync, **kw):
        seen["rounds"] = sorted(calls)
        return {n: [1.0, 3.0] for n in calls}

    def fake_time_calls(call, sync, iters, reps=5):
        seen.setdefault("alone", []).append(call())
        return {"xla fwd": 7.0, "xla bwd": 9.0}[call()]

    monkeypatch.setattr(ab_timing, "interleaved", fake_rounds)
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


def test_the_nopdl_peer_is_set_up_and_called_with_pdl_off(monkeypatch):
    """jax_fa4_nopdl (``ENV_OF``): JAX_FA4_PDL=0 holds whenever JAX traces and lowers
    its functions (at set-up and at each first call), and is restored after."""
    monkeypatch.delenv("JAX_FA4_PDL", raising=False)
    seen = []
    xla = ba.jax_impls({"xla"})["xla"]

    def attn(q, k, v, c):
        seen.append(os.environ.get("JAX_FA4_PDL"))
        return xla(q, k, v, c)

    assert {"jax_fa4_pdl", "jax_fa4_nopdl"} <= set(ba.jax_impls({"pdl", "nopdl"}))
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 32, 2, 32), jnp.bfloat16)
               for i in range(3))
    prep = ba.prepare_jax("jax_fa4_nopdl", attn, q, k, v, True, "direct")
    assert "JAX_FA4_PDL" not in os.environ
    n_setup = len(seen)
    prep.sync(prep.fwd())  # the forward is traced at its first call
    prep.sync(prep.bwd())
    assert n_setup > 0 and len(seen) > n_setup
    assert set(seen) == {"0"}, seen
    assert "JAX_FA4_PDL" not in os.environ
    # Once compiled, calls neither retrace nor pay for patching the environment.
    entered, real, n_traced = [], ba.environment, len(seen)
    monkeypatch.setattr(ba, "environment", lambda env: (entered.append(env), real(env))[1])
    prep.sync(prep.fwd())
    prep.sync(prep.bwd())
    assert entered == [] and len(seen) == n_traced
    monkeypatch.setenv("JAX_FA4_PDL", "1")
    with ba.environment({"JAX_FA4_PDL": "0"}):
        assert os.environ["JAX_FA4_PDL"] == "0"
    assert os.environ["JAX_FA4_PDL"] == "1"


def test_the_store_first_peers_lower_with_the_switch_set():
    """jax_fa4_storefirst / jax_fa4_zerodq: the same attention, lowered with
    JAX_FA4_DQ_STORE_FIRST=1 / 0 (the backward that stores each query block's first
    dQ partial / zeroes dQaccum in its preprocess), for A/B runs in one process."""
    from jax_fa4.config import DQ_STORE_FIRST_ENV

    impls = ba.jax_impls({"storefirst", "zerodq"})
    assert impls["jax_fa4_zerodq"] is impls["jax_fa4_storefirst"] is impls["jax_fa4"]
    assert ba.ENV_OF["jax_fa4_storefirst"] == {DQ_STORE_FIRST_ENV: "1"}
    assert ba.ENV_OF["jax_fa4_zerodq"] == {DQ_STORE_FIRST_ENV: "0"}
    assert "jax_fa4_zerodq" not in ba.jax_impls({"pdl", "nopdl"})
    # Store first by length: the on / off switch is blanked (unset for the kernels).
    from jax_fa4.config import (
        DQ_FIRST_MAX_SQ_ENV,
        dq_first_max_sq_override,
        dq_store_first_override,
    )

    impls = ba.jax_impls({"firstbylen"})
    assert impls["jax_fa4_firstbylen"] is impls["jax_fa4"]
    with ba.environment(ba.ENV_OF["jax_fa4_firstbylen"]):
        assert dq_store_first_override("sm_90a", 128) is None
        assert dq_first_max_sq_override() == 2048 == int(os.environ[DQ_FIRST_MAX_SQ_ENV])


def test_the_fold_peers_lower_with_the_switch_set():
    """jax_fa4_fold / jax_fa4_nofold: the same attention, lowered with
    JAX_FA4_DQ_FOLD=1 / 0 (dQ converted in the main kernel / by the postprocess,
    Note [dQ fold]) and the store-first switches blanked, for A/B runs."""
    from jax_fa4.config import dq_first_max_sq_override, dq_fold_override, dq_store_first_override

    impls = ba.jax_impls({"fold", "nofold"})
    assert impls["jax_fa4_fold"] is impls["jax_fa4_nofold"] is impls["jax_fa4"]
    for name, want in (("jax_fa4_fold", True), ("jax_fa4_nofold", False)):
        with ba.environment(ba.ENV_OF[name]):
            assert dq_fold_override("sm_90a", 128) == want
            assert dq_store_first_override("sm_90a", 128) is None
            assert dq_first_max_sq_override() is None
