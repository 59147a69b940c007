"""CPU compile checks for the sm90 head-dim-256 backward main kernel
(kernels/sm90_bwd_wide.py).

Lowers FlashBwdSm90Wide through cutlass.jax.cutlass_call for sm_90a (cute.compile
runs on the CPU, no GPU needed) with dynamic B, S, H (divisibility 1), for bf16 and
fp16, causal or not, on the default GQA shape with ragged lengths and on a
one-of-everything shape, and checks that the HLO holds the custom call. For both
mask modes it also reads the SASS (wgmma present, setmaxnreg kept, no local memory)
and runs `ptxas -v` on the dumped PTX (no spill bytes, no wgmma serialization
warning C75xx).
"""

import importlib.util
import re
import shutil
import subprocess

import jax.numpy as jnp
import pytest
from kernel_compile import count, dump_options, lower_bwd, read_dump

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

HEAD_DIM = 256
# wgmma instructions of one query block per warpgroup: S and dP 16 each (m64n32,
# k = 256), dV^T and dK^T 8 each (two m64n64 atoms, k = 64), dQ 4 (m64n128, k = 64).
HGMMA_PER_BLOCK = 16 + 16 + 8 + 8 + 4


def _lower(dtype, causal: bool, shape=None, compile_options: str | None = None) -> str:
    from jax_fa4.kernels.sm90_bwd_wide import FlashBwdSm90Wide

    kwargs = {} if shape is None else {"shape": shape}
    return lower_bwd(FlashBwdSm90Wide, "sm_90a", dtype, HEAD_DIM, causal,
                     compile_options=compile_options, **kwargs)


@needs_cutlass
@pytest.mark.parametrize("shape", [None, (1, 1, 1, 1, 1)], ids=["gqa_ragged", "ones"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_wide_bwd_compiles(dtype, causal, shape):
    assert "custom_call" in _lower(dtype, causal, shape)


@needs_cutlass
def test_wide_bwd_rejects_unsupported_configs():
    import cutlass

    from jax_fa4.kernels.sm90_bwd_wide import BwdTilesWide, FlashBwdSm90Wide

    with pytest.raises(ValueError):
        FlashBwdSm90Wide(cutlass.BFloat16, 128, 128, False, 0.1)
    with pytest.raises(ValueError):
        FlashBwdSm90Wide(cutlass.BFloat16, 256, 128, False, 0.1)
    with pytest.raises(ValueError):  # a second Q/dO stage does not fit in SMEM
        FlashBwdSm90Wide(cutlass.BFloat16, 256, 256, False, 0.1,
                         BwdTilesWide(stages_qdo=2))
    with pytest.raises(TypeError):
        FlashBwdSm90Wide(cutlass.Float32, 256, 256, False, 0.1)
    # Same constructor as FlashBwdSm90: positional (dtype, head_dim, head_dim_v,
    # causal, softmax_scale), defaults for the rest.
    k = FlashBwdSm90Wide(cutlass.Float16, 256)
    assert k.head_dim_v == 256 and not k.causal and k.softmax_scale == pytest.approx(1 / 16)


def _ptxas_report(ptx_path: str) -> str:
    proc = subprocess.run(
        ["ptxas", "-v", "-arch=sm_90a", ptx_path, "-o", ptx_path + ".cubin"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True])
def test_wide_bwd_sass(tmp_path, causal):
    _lower(jnp.bfloat16, causal, compile_options=dump_options(tmp_path))
    sass = read_dump(tmp_path, "sass")
    if sass is None:
        pytest.skip("no SASS was dumped (disassembler unavailable to the DSL)")
    hgmma = count(r"\bHGMMA\.", sass)
    assert hgmma >= HGMMA_PER_BLOCK, f"{hgmma} wgmma instructions, expected {HGMMA_PER_BLOCK}"
    assert "USETMAXREG" in sass, "setmaxnreg was dropped"
    local = count(r"\b(?:LDL|STL)\b", sass)
    assert local == 0, f"{local} local-memory instructions in the SASS"

    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    ptx_files = sorted(tmp_path.glob("*.ptx"))
    assert ptx_files, "no PTX was dumped"
    report = _ptxas_report(str(ptx_files[0]))
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    assert all(s == ("0", "0") for s in spills), report
    # C75xx: ptxas serialized wgmma (e.g. accumulator registers touched in flight).
    assert "C75" not in report, report


@needs_cutlass
def test_wide_bwd_dq_smem_addresses():
    """The dQ SMEM store's 4-base address arithmetic (Note [dQ SMEM addresses])
    against the plain 128-byte swizzle of every (thread, register) of the dQ
    accumulator, at trace time with static thread indices."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from jax_fa4.kernels import sm90_bwd_wide as wide
    from jax_fa4.kernels.cute_utils import sm90_smem_layout

    kernel = wide.FlashBwdSm90Wide(cutlass.BFloat16, HEAD_DIM)
    tm, d = kernel.tile_m, kernel.head_dim
    mismatches, addresses = [], set()

    def byte_swizzle_128(lin):  # written out in bytes, as the TMA box sees it
        b = 4 * lin
        return (b ^ ((b >> 3) & 0x70)) // 4

    def walk():  # plain Python: runs once while the jit function below traces
        _, _, mma_dq = kernel._tiled_mmas()
        outer = sm90_smem_layout(Float32, tm, d, None).outer
        for t in range(kernel.num_mma_threads):
            thr = mma_dq.get_slice(t)
            coords = thr.partition_C(cute.make_identity_tensor((tm, d)))
            n_regs = cute.size(thr.partition_shape_C((tm, d)))
            for reg in range(n_regs):
                e, i, j = reg % 2, (reg // 2) % 2, reg // 4
                jp, jj = j % 4, j // 4
                ref = byte_swizzle_128(cute.crd2idx(coords[reg], outer))
                base = wide.swizzle128_f32(cute.crd2idx(coords[4 * jp], outer))
                mine = base + sum(x * s for x, s in zip((e, i, jj), wide._DQ_SMEM_STRIDE))
                reg_mine = 4 * jp + sum(
                    x * s for x, s in zip((e, i, jj), wide._DQ_REG_STRIDE))
                if (mine, reg_mine) != (ref, reg):
                    mismatches.append((t, reg, ref, mine, reg_mine))
                addresses.add(ref)

    @cute.jit
    def trace():
        walk()

    from jax_fa4.ffi.bridge import pinned_arch

    with pinned_arch("sm_90a"):  # the DSL keeps one target per process
        cute.compile(trace)
    assert not mismatches, mismatches[:8]
    assert len(addresses) == tm * d  # every element of the tile written exactly once
