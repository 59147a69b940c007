"""CPU checks of scripts/step_compare.py's SASS step parsing (the compiles themselves
need flash-attn-4's wheel, which CI does not have)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

SASS = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0120*/                   FMNMX R2, R24, R25, !PT ;
        /*0130*/              @!P5 SYNCS.ARRIVE.TRANS64.ART0 RZ, [UR28+0x20], R20 ;
        /*0140*/                   MUFU.EX2 R3, R2 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0160*/                   F2FP.BF16.F32.PACK_AB R4, R3, R3 ;
        /*0170*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0190*/                   FADD R5, R4, R3 ;
        /*01a0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
"""


def test_steps_run_from_each_s_ready_wait_to_the_next_hgmma():
    import step_compare

    found = step_compare.steps(SASS)
    assert [len(s) for s in found] == [7, 3]
    assert found[0][0] == "WARPGROUP.DEPBAR.LE gsb0, 0x1" and found[0][-1].startswith("HGMMA")
    assert [step_compare.opcode(x) for x in found[0][:-1]] == [
        "WARPGROUP", "FMNMX", "SYNCS", "MUFU", "WARPGROUP", "F2FP"]  # predicate skipped
    assert step_compare.opcode("@!P0 BRA P1, `(.L_x_20)") == "BRA"


def test_describe_prints_counts_and_letters(capsys):
    import step_compare

    step_compare.describe("k", SASS)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== k: 11 instructions, 2 step(s)"
    assert out[1].startswith("step 0: 6 instructions: WARPGROUP 2, FMNMX 1")
    assert out[2] == "Wx.MWPH" and out[4] == "WaH"


LOOPS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
.L_x_1:
        /*0020*/                   FADD R2, R2, R3 ;
        /*0030*/                   SHFL.IDX PT, R4, R2, R5, 0x1f ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0060*/              @!P1 BRA `(.L_x_0) ;
        /*0070*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0080*/                   EXIT ;
"""


def test_loops_are_the_backward_branches_around_wgmmas():
    """loops() keeps a branch to an earlier label whose body holds an HGMMA (the
    outer loop), not one without (the inner FADD / SHFL loop) nor a forward branch."""
    import step_compare

    found = step_compare.loops(LOOPS)
    assert len(found) == 1
    start, body = found[0]
    assert start == 1 and len(body) == 6
    assert body[0].startswith("HGMMA") and body[-1] == "@!P1 BRA `(.L_x_0)"


def test_describe_loops_prints_opcode_counts(capsys):
    import step_compare

    step_compare.describe_loops("k", LOOPS)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== k: 9 instructions, 1 loop(s) with wgmmas"
    assert out[1].startswith("loop at instruction 1: 6 instructions: HGMMA 2, BRA 2")
