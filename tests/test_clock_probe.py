"""CPU checks of scripts/clock_probe.py's sample parsing and of the --tiles knob
parser it shares with scripts/gpu_check_fwd.py."""

import datetime
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))


def test_read_samples_parses_nvidia_smi_lines(tmp_path):
    import clock_probe

    path = tmp_path / "smi.csv"
    path.write_text(
        "2026/11/30 10:30:00.125, 1755, 690.41, 61, 0x0000000000000004\n"
        "2026/11/30 10:30:00.145, 1980, 120.00, 40\n"
        "garbage line\n"
        "2026/11/30 10:30:00.165, [N/A], 690.0, 61, 0x4\n")
    got = clock_probe.read_samples(str(path))
    t0 = datetime.datetime(2026, 11, 30, 10, 30, 0, 125000).timestamp()
    assert [(round(t - t0, 3), mhz, w, r) for t, mhz, w, r in got] == [
        (0.0, 1755.0, 690.41, "0x0000000000000004"), (0.02, 1980.0, 120.0, None)]


def test_tile_variant_parses_knob_specs():
    pytest.importorskip("cutlass")
    from gpu_check_fwd import resolve, tile_variant

    assert tile_variant("st3+oq") == {"num_stages": 3, "separate_o": False}
    assert tile_variant("n176") == {"tile_n": 176}
    assert tile_variant("sw8+rsa") == {"sw_exp2_per_32": 8, "rescale_always": True}
    with pytest.raises(ValueError, match="unknown tile knob"):
        tile_variant("st3+bogus")
    tiles = resolve(tile_variant("st3"), 64, True)
    assert tiles.num_stages == 3 and tiles.tile_m == 192
    assert resolve(tile_variant("lpt"), 128, False) is False  # causal only


def test_case_shape_defaults_and_overrides():
    import clock_probe

    # The benchmark's shape: 16k tokens, hidden 2048.
    assert clock_probe.case_shape(128, 16384) == (1, 16)
    assert clock_probe.case_shape(64, 8192) == (2, 32)
    assert clock_probe.case_shape(256, 1024) == (16, 8)
    # Overrides, one or both (a below-the-cap probe: 64 tiles of hdim 128 at 8k).
    assert clock_probe.case_shape(128, 8192, heads=1) == (2, 1)
    assert clock_probe.case_shape(128, 8192, batch=1, heads=1) == (1, 1)
    assert clock_probe.case_shape(128, 32768) == (1, 16)  # longer than 16k: one sequence


@pytest.mark.parametrize("argv", [["--batch", "-1"], ["--fa4-graph", "8", "--no-fa4"],
                                  ["--fa4-graph", "8", "--dirs", "fwd,bwd"]])
def test_probe_refuses_bad_arguments(monkeypatch, capsys, argv):
    import clock_probe

    monkeypatch.setattr(sys, "argv", ["clock_probe.py", *argv])
    with pytest.raises(SystemExit) as exc:
        clock_probe.main()
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bwd_main_call_serves_hdim_64_128_only():
    """--bwd-variants: a call of the backward main kernel variant at hdim 64 / 128
    (built, not run: this machine has no GPU), none at hdim 256, whose backward is
    another kernel; an unknown variant is an error, not a skip."""
    pytest.importorskip("cutlass")
    import clock_probe

    assert callable(clock_probe.bwd_main_call(64, False, (1, 256, 2), "shfl"))
    assert callable(clock_probe.bwd_main_call(128, True, (1, 128, 2), "default"))
    assert clock_probe.bwd_main_call(256, True, (1, 128, 2), "default") is None
    with pytest.raises(ValueError, match="unknown variant knob"):
        clock_probe.bwd_main_call(64, True, (1, 128, 2), "bogus")
