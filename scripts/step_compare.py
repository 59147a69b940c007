"""Compile jax_fa4's and flash-attn-4's sm90 forwards on a CPU machine and compare the
SASS of their KV loop steps, without a GPU.

flash-attn-4's kernel is compiled from its wheels in --wheels (flash_attn_4 and
quack_kernels, e.g. `pip download --no-deps -d .device/wheels flash-attn-4==4.0.0b36
quack-kernels==0.6.5`), unpacked into --src. Its package imports PyTorch, Triton,
tvm_ffi and einops at module level for its host-side interface; none of them takes
part in compiling the kernel, so they are replaced by stand-in modules here. The
kernel is built with the options flash-attn-4's interface uses on sm90 (2 K/V stages,
intra-warpgroup overlap, P as the register operand of P V) and compiled against fake
tensors of (B, S, 16, D).

A step is printed from each S-ready wait (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) to
the next HGMMA: its length, its opcode counts and a one-letter string (M MUFU,
a FADD, f FFMA, m FMUL, P F2FP, x FMNMX, W wgmma wait, | branch, H HGMMA, . other).

With --bwd the two sm90 backward main kernels are compiled instead (flash-attn-4's
with its own tile table, ``_tile_size_bwd_sm90``; ours with the table's, no GQA), and
every loop that holds wgmmas is listed with its length and opcode counts.

    python scripts/step_compare.py [--hdim 128] [--causal] [--bwd]
        [--wheels .device/wheels] [--src /tmp/jax_fa4_fa4src] [--out /tmp/step_compare]
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.abc
import importlib.machinery
import os
import pathlib
import re
import sys
import zipfile
from unittest import mock

here = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(here.parent), str(here.parent / "tests")]

# Modules flash-attn-4 and quack import for their host side only.
_STAND_IN = ("torch", "triton", "tvm_ffi", "torch_c_dlpack_ext", "einops")

LETTERS = {"MUFU": "M", "FADD": "a", "FFMA": "f", "FMUL": "m", "F2FP": "P", "FMNMX": "x",
           "BRA": "|", "HGMMA": "H"}


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the packages in _STAND_IN give MagicMock modules."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in _STAND_IN:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock()
        module.__path__, module.__name__, module.__spec__ = [], spec.name, spec
        if spec.name == "torch":
            # Used in isinstance checks and as base classes at import time.
            module.Tensor = type("Tensor", (), {})
            module.device = type("device", (), {})
            module.autograd.Function = type(
                "Function", (), {"apply": classmethod(lambda cls, *a: None)})
            module.nn.Module = type("Module", (), {})
            module.cuda.is_available.return_value = False
            module.cuda.get_device_capability.return_value = (9, 0)
        return module

    def exec_module(self, module):
        pass


def unpack(wheels: str, src: str) -> None:
    """Unpack the flash_attn_4 and quack_kernels wheels into src (once)."""
    for pattern, package in (("flash_attn_4-*.whl", "flash_attn"),
                             ("quack_kernels-*.whl", "quack")):
        if os.path.isdir(os.path.join(src, package)):
            continue
        found = sorted(glob.glob(os.path.join(wheels, pattern)))
        if not found:
            sys.exit(f"no {pattern} in {wheels}: pip download --no-deps -d {wheels} "
                     "flash-attn-4 quack-kernels")
        with zipfile.ZipFile(found[-1]) as z:
            z.extractall(src)


def _fa4_importable(src: str) -> None:
    """flash-attn-4 and quack importable from src, their host-only imports stood in."""
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIns())
    if src not in sys.path:
        sys.path.insert(0, src)


def _fake_bshd(b, s, d: int):
    """A fake bf16 (B, S, 16, d) tensor as flash-attn-4's interface passes them
    (head dim contiguous, then heads)."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(
        cutlass.BFloat16, (b, s, 16, d), stride_order=(3, 1, 2, 0), assumed_align=16)


def compile_fa4(d: int, causal: bool, out: pathlib.Path, src: str) -> str:
    """flash-attn-4's sm90 forward for bf16 (B, S, 16, d); returns its SASS."""
    _fa4_importable(src)
    from jax_fa4.ffi.bridge import pinned_arch

    with pinned_arch("sm_90a"):  # also for a first cutlass import, which reads the target
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

        tile_m = 192 if d <= 64 else 128  # its sm90 table: 192 rows, 3 consumers at d <= 96
        kernel = FlashAttentionForwardSm90(
            cutlass.BFloat16, d, d, 1, is_causal=causal, is_local=False, pack_gqa=False,
            tile_m=tile_m, tile_n=128 if d <= 128 else 80, num_stages=2,
            num_threads=(tile_m // 64 + 1) * 128, Q_in_regs=False, intra_wg_overlap=True,
            mma_pv_is_rs=True)
        # Batch and sequence length dynamic, as in its interface (a static shape makes
        # its LPT scheduler's loop state change type in the causal kernel).
        b, s = cute.sym_int(), cute.sym_int()

        def bshd():
            return _fake_bshd(b, s, d)

        lse = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (b, 16, s),
                                                    stride_order=(2, 1, 0), assumed_align=4)
        out.mkdir(parents=True, exist_ok=True)
        cute.compile(kernel, bshd(), bshd(), bshd(), bshd(), lse, cutlass.Float32(d ** -0.5),
                     stream=cute.runtime.make_fake_stream(),
                     options=f"--keep-ptx --keep-sass --dump-dir={out}")
    return _read_sass(out)


def compile_fa4_bwd(d: int, causal: bool, out: pathlib.Path, src: str) -> str:
    """flash-attn-4's sm90 backward main kernel for bf16 (B, S, 16, d), its own tile
    table (``_tile_size_bwd_sm90``) and arguments as its interface builds them
    (no GQA: dK and dV written directly); returns its SASS."""
    _fa4_importable(src)
    from jax_fa4.ffi.bridge import pinned_arch

    with pinned_arch("sm_90a"):
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
        from flash_attn.cute.interface import _tile_size_bwd_sm90

        cfg = _tile_size_bwd_sm90(d, d, causal, False)
        kernel = FlashAttentionBackwardSm90(
            cutlass.BFloat16, d, d, 1, causal, is_local=False, deterministic=False,
            tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q,
            dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
            SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
            AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
            AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128,
            dQ_single_wg=getattr(cfg, "dQ_single_wg", False))
        b, s, s_rounded = cute.sym_int(), cute.sym_int(), cute.sym_int()

        def bshd():
            return _fake_bshd(b, s, d)

        def f32(*shape):
            return cute.runtime.make_fake_compact_tensor(
                cutlass.Float32, shape, stride_order=tuple(range(len(shape)))[::-1],
                assumed_align=16)

        out.mkdir(parents=True, exist_ok=True)
        cute.compile(kernel, bshd(), bshd(), bshd(), bshd(), f32(b, 16, s_rounded),
                     f32(b, 16, s_rounded), f32(b, 16, s_rounded * d), bshd(), bshd(),
                     cutlass.Float32(d ** -0.5), None, None, None, None, None, None, None,
                     None, None, stream=cute.runtime.make_fake_stream(),
                     options=f"--keep-ptx --keep-sass --dump-dir={out}")
    return _read_sass(out)


def compile_ours(d: int, causal: bool, out: pathlib.Path) -> str:
    """jax_fa4's table forward for bf16 at head dim d; returns its SASS."""
    import jax.numpy as jnp
    from kernel_compile import dump_options, lower_fwd_sm90

    lower_fwd_sm90(jnp.bfloat16, d, causal, compile_options=dump_options(out))
    return _read_sass(out)


def compile_ours_bwd(d: int, causal: bool, out: pathlib.Path) -> str:
    """jax_fa4's table sm90 backward main kernel for bf16 at head dim d, no GQA."""
    import jax.numpy as jnp
    from kernel_compile import dump_options, lower_bwd

    from jax_fa4.kernels.sm90_bwd import FlashBwdSm90

    lower_bwd(FlashBwdSm90, "sm_90a", jnp.bfloat16, d, causal, shape=(2, 113, 203, 4, 4),
              compile_options=dump_options(out))
    return _read_sass(out)


def _read_sass(folder: pathlib.Path) -> str:
    files = sorted(folder.glob("*.sass"))
    if not files:
        sys.exit(f"no SASS in {folder}: the DSL needs nvdisasm (pip nvidia-cuda-nvdisasm)")
    return files[0].read_text()


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);")


def steps(sass: str) -> list[list[str]]:
    """The instructions of each step: from an S-ready wait to the next HGMMA."""
    ins = [m.group(1).strip() for m in _INSTRUCTION.finditer(sass)]
    out = []
    for i, x in enumerate(ins):
        if "DEPBAR.LE gsb0, 0x1" in x:
            j = next((k for k in range(i + 1, len(ins)) if ins[k].startswith("HGMMA")), len(ins))
            out.append(ins[i:j + 1])
    return out


def opcode(instruction: str) -> str:
    parts = instruction.split()
    return (parts[1] if parts[0].startswith("@") else parts[0]).split(".")[0]


def describe(name: str, sass: str) -> None:
    found = steps(sass)
    total = len(_INSTRUCTION.findall(sass))
    print(f"== {name}: {total} instructions, {len(found)} step(s)")
    for n, step in enumerate(found):
        counts = collections.Counter(opcode(x) for x in step[:-1])
        letters = "".join("W" if x.startswith("WARPGROUP.DEPBAR") else
                          LETTERS.get(opcode(x), ".") for x in step)
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(12))
        print(f"step {n}: {len(step) - 1} instructions: {top}")
        print(letters)


_LINE = re.compile(r"^\s*(?:(\.L_x_\d+):|/\*([0-9a-f]{4,})\*/\s+([^;]*);)", re.M)


def loops(sass: str) -> list[tuple[int, list[str]]]:
    """The loops (a branch back to an earlier label) whose bodies hold wgmmas:
    (the label's position, the instructions from the label to the branch),
    longest first."""
    ins, labels = [], {}
    for m in _LINE.finditer(sass):
        if m.group(1):
            labels[m.group(1)] = len(ins)
        else:
            ins.append(m.group(3).strip())
    found = []
    for i, x in enumerate(ins):
        target = re.search(r"\((\.L_x_\d+)\)", x) if opcode(x) == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            body = ins[labels[target.group(1)]:i + 1]
            if any(y.startswith("HGMMA") for y in body):
                found.append((labels[target.group(1)], body))
    return sorted(found, key=lambda f: -len(f[1]))


def describe_loops(name: str, sass: str) -> None:
    total = len(_INSTRUCTION.findall(sass))
    found = loops(sass)
    print(f"== {name}: {total} instructions, {len(found)} loop(s) with wgmmas")
    for start, body in found:
        counts = collections.Counter(opcode(x) for x in body)
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(16))
        print(f"loop at instruction {start}: {len(body)} instructions: {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdim", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--wheels", default=str(here.parent / ".device" / "wheels"))
    ap.add_argument("--src", default="/tmp/jax_fa4_fa4src")
    ap.add_argument("--out", default="/tmp/step_compare")
    ap.add_argument("--bwd", action="store_true",
                    help="the backward main kernels: their wgmma loops' opcode counts")
    args = ap.parse_args()
    out = pathlib.Path(args.out) / (f"d{args.hdim}_{'c' if args.causal else 'nc'}"
                                    + ("_bwd" if args.bwd else ""))
    unpack(args.wheels, args.src)
    if args.bwd:
        if args.hdim == 256:
            ap.error("jax_fa4's sm90 backward at head dim 256 is another kernel (sm90_bwd_wide)")
        describe_loops("jax_fa4", compile_ours_bwd(args.hdim, args.causal, out / "jax_fa4"))
        describe_loops("flash-attn-4",
                       compile_fa4_bwd(args.hdim, args.causal, out / "fa4", args.src))
        return
    describe("jax_fa4", compile_ours(args.hdim, args.causal, out / "jax_fa4"))
    describe("flash-attn-4", compile_fa4(args.hdim, args.causal, out / "fa4", args.src))


if __name__ == "__main__":
    main()
