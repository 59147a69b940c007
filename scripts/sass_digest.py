"""Digest the SASS of every kernel the lowering builds, on a CPU machine.

Each configuration (architecture, dtype, head dims, causal, deterministic, whether
the LSE has a cotangent) is lowered through ``jax_fa4.attention`` and its gradient
for platform cuda; the CuTe DSL dumps the SASS of every kernel it compiles, and this
script writes one line per kernel, under the first configuration that builds it: the
configuration, the kernel's kind, a digest of its SASS (addresses and the kernel's
own name taken out) and a digest of its opcode sequence. Two such files compared
(``--compare``) tell whether a change to the sources changed any machine code.

    python scripts/sass_digest.py --out /tmp/sass_before.txt [--arch sm_90a,sm_100a]
    python scripts/sass_digest.py --out /tmp/sass_after.txt
    python scripts/sass_digest.py --compare /tmp/sass_before.txt /tmp/sass_after.txt

Needs nvidia-cuda-nvdisasm (the test extra) for the DSL to write SASS.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import itertools
import os
import pathlib
import re
import sys
import tempfile


def _normalise(sass: str) -> str:
    lines = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)  # instruction addresses
        line = re.sub(r"/\*\s*0x[0-9a-f]+\s*\*/", "", line)  # encodings
        line = re.sub(r"kernel_\w+", "KERNEL", line)
        line = re.sub(r"0x[0-9a-f]+ \(\.L_x_\d+\)", "LABEL", line)
        if line.strip():
            lines.append(line.rstrip())
    return "\n".join(lines)


def _opcodes(sass: str) -> str:
    """The instruction sequence without operands: ptxas's register numbering of
    the sm_100a backward varies from one compile of the same source to the next."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)\b", line)
        if m:
            ops.append(m.group(2))
    return "\n".join(ops)


def _configs(archs):
    from jax_fa4.config import KERNEL_HEAD_DIMS

    for arch in archs:
        for (d, dv), causal, det, lse in itertools.product(
            KERNEL_HEAD_DIMS[arch], (False, True), (False, True), (False, True)
        ):
            for dtype in ("bfloat16", "float16"):
                yield arch, dtype, d, dv, causal, det, lse


def _lower(arch, dtype, d, dv, causal, det, lse):
    import jax
    import jax.numpy as jnp

    import jax_fa4

    b, s, h = 2, 256, 4
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct((b, s, h, dv), jnp.dtype(dtype))

    def loss(q, k, v):
        out = jax_fa4.attention(q, k, v, causal=causal, deterministic=det,
                                return_lse=lse, implementation="cute")
        if lse:
            out, l = out
            return out.astype(jnp.float32).sum() + l.sum()
        return out.astype(jnp.float32).sum()

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, v).lower(
        lowering_platforms=("cuda",))


def digest(archs, out_path: str) -> None:
    dump = pathlib.Path(tempfile.mkdtemp(prefix="jax_fa4_sass_"))
    os.environ["CUTE_DSL_KEEP"] = "sass"
    os.environ["JAX_FA4_CACHE_DIR"] = "0"
    os.environ.setdefault("CUTE_DSL_ARCH", archs[0])
    from cutlass.cutlass_dsl.cutlass import CuTeDSL  # no public setter for the dump folder

    from jax_fa4.ffi import bridge

    envar = CuTeDSL._get_dsl().envar
    compile_kernel = bridge.compile_kernel
    seen = []

    def dumping_compile(key, *args, **kwargs):
        # One folder per kernel key: the DSL names its dumps after a truncated
        # signature, which two kernels with the same operands share.
        folder = dump / f"k{len(seen)}"
        folder.mkdir()
        seen.append((key, folder))
        envar.dump_dir = str(folder)
        return compile_kernel(key, *args, **kwargs)

    bridge.compile_kernel = dumping_compile
    rows = []
    for cfg in _configs(archs):
        os.environ["JAX_FA4_ARCH"] = cfg[0]
        bridge._compiled.clear()
        start = len(seen)
        _lower(*cfg)
        for key, folder in seen[start:]:
            for path in sorted(glob.glob(str(folder / "*.sass"))):
                text = _normalise(pathlib.Path(path).read_text())
                h = hashlib.sha256(text.encode()).hexdigest()[:16]
                ops = hashlib.sha256(_opcodes(text).encode()).hexdigest()[:16]
                row = f"{' '.join(map(str, cfg))} {key.kind} {h} {ops}"
                print(row, flush=True)
                rows.append(row)
    pathlib.Path(out_path).write_text("\n".join(rows) + "\n")


def compare(a: str, b: str) -> int:
    """Kernels are matched by (arch, dtype, head dims, kind): the set of SASS digests
    under each must be the same (which configuration built a kernel first, and how
    kernels are shared between configurations, may differ)."""

    def load(p):
        rows = {}
        for line in pathlib.Path(p).read_text().splitlines():
            arch, dtype, d, dv, *_, kind, h, ops = line.split()
            rows.setdefault((arch, dtype, d, dv, kind), set()).add((h, ops))
        return rows

    ra, rb = load(a), load(b)
    bad = 0
    for k in sorted(set(ra) | set(rb)):
        a, b = ra.get(k, set()), rb.get(k, set())
        if a == b:
            continue
        if {ops for _, ops in a} == {ops for _, ops in b}:
            print("REGISTERS ONLY", *k)
            continue
        bad += 1
        print("DIFFERS", *k, sorted(a), sorted(b))
    print(f"{len(set(ra) | set(rb))} kernel groups compared, {bad} differ in their instructions")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90a,sm_100a")
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    digest(args.arch.split(","), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
