"""Compile time of jax_fa4's kernels: first call in a fresh process, cold and cached.

For every kernel configuration the benchmark (bench_attention.py) uses and the
GPU's architecture has a kernel for (bf16; head dims of its cases; causal or
not), each measurement runs in its own fresh Python process (sys.executable -c)
and times the first call of a jitted forward, and separately of a jitted
forward + backward step (4 kernels: fwd, bwd_pre, bwd, bwd_post), then a second
call. Phases:

  cold   jax_fa4's disk cache off (JAX_FA4_CACHE_DIR=0) and an empty CuTe DSL
         file cache (CUTE_DSL_CACHE_DIR, a new empty folder per process): a
         first-ever compile.
  warm   jax_fa4's disk cache filled by an earlier process (a temp folder),
         empty DSL file cache: the normal second run.
  dsl    (opt-in) jax_fa4's disk cache off, the DSL's own file cache filled by
         an earlier process. With CuTe DSL 4.8.1 the JAX bridge's compile path
         writes nothing to that cache, so this phase should read as cold; it
         checks that.

One more process per configuration ("populate", in the CSV only) fills the
caches; it is a cold fwd+bwd run that also writes them. JAX's own persistent
compilation cache is off in every process, so "warm" measures jax_fa4's cache
alone.

Columns: first = the first call of the jitted function, from the call to the
result on the host (tracing, lowering with the kernel compiles, XLA compile,
the run); cute = the CuTe DSL part, read from jax_fa4.ffi.bridge.compile_seconds,
which the bridge times around each kernel's compile (or, on a jax_fa4 cache
hit, its load from disk); other = first - cute - second (tracing, XLA compile,
one-off set-up), second = the second call. The import of jax + jax_fa4 and
of the CuTe DSL come before the first call and are reported apart.

Needs an NVIDIA GPU with a jax_fa4 kernel (sm_90a): without one it says so
and exits 0, measuring nothing (the reference path is no kernel).

    python benchmarks/compile_time.py [--out DIR|FILE.csv] [--phases cold,warm[,dsl]]
        [--hdims 64,128,256]

The CSV goes to --out (default ./bench_out).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's jax_fa4, installed or not

from bench_attention import FULL_CASES, HIDDEN, TOKENS  # noqa: E402 - after the path set-up

PHASES = ("cold", "dsl", "warm")
DEFAULT_PHASES = ("cold", "warm")
STEPS = ("fwd", "fwdbwd")

# Runs in each fresh process; argv[1] is a JSON spec; prints one "RESULT {json}" line.
CHILD = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["root"])
t0 = time.perf_counter()
import jax
import jax.numpy as jnp
import jax_fa4
from jax_fa4.ffi import bridge
t1 = time.perf_counter()
err = bridge.cutlass_available(spec["arch"])  # imports the CuTe DSL and its JAX bridge
t2 = time.perf_counter()
if err is not None:
    print("RESULT " + json.dumps({"error": err}))
    sys.exit(0)
d, s, b, h, causal = spec["hdim"], spec["seqlen"], spec["batch"], spec["heads"], spec["causal"]
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, dout = (jax.random.normal(x, (b, s, h, d), jnp.bfloat16) for x in ks)
jax.block_until_ready((q, k, v, dout))


def attn(q, k, v):
    return jax_fa4.attention(q, k, v, causal=causal, implementation="cute")


def step(q, k, v, dout):
    _, pull = jax.vjp(attn, q, k, v)
    return pull(dout)


fn, args = (jax.jit(attn), (q, k, v)) if spec["step"] == "fwd" else (jax.jit(step), (q, k, v, dout))
t3 = time.perf_counter()
jax.block_until_ready(fn(*args))
t4 = time.perf_counter()
jax.block_until_ready(fn(*args))
t5 = time.perf_counter()
kernels = {key.kind: sec for key, sec in bridge.compile_seconds.items()}
print("RESULT " + json.dumps(dict(
    import_s=t1 - t0, import_dsl_s=t2 - t1, first_s=t4 - t3, second_s=t5 - t4,
    cute_s=sum(kernels.values()), kernels=kernels,
)))
"""

FIELDS = ("hdim", "causal", "phase", "step", "seqlen", "batch", "heads", "first_s", "cute_s",
          "other_s", "second_s", "import_s", "import_dsl_s", "n_kernels", "kernels", "error")


def gpu_arch() -> tuple[str | None, str]:
    """(jax_fa4 kernel architecture of the first CUDA device, description), or (None, why)."""
    import jax

    from jax_fa4.config import KERNEL_HEAD_DIMS, arch_from_compute_capability

    try:
        devices = jax.devices("cuda")
    except RuntimeError as e:
        return None, f"no CUDA device visible to JAX ({e})"
    if not devices:
        return None, "no CUDA device visible to JAX"
    dev = devices[0]
    cc = getattr(dev, "compute_capability", None)
    arch = arch_from_compute_capability(cc)
    if arch not in KERNEL_HEAD_DIMS:
        return None, f"{dev.device_kind} (compute capability {cc}) has no jax_fa4 kernel"
    return arch, f"{dev.device_kind}, compute capability {cc}, kernels for {arch}"


def configs(arch: str, hdims: list[int] | None):
    """[(hdim, causal, seqlen)] the benchmark uses and `arch` has kernels for; [(hdim, why)] not."""
    from jax_fa4.config import kernel_support_error

    wanted = hdims or sorted({d for d, _, _ in FULL_CASES})
    run, skipped = [], []
    for d in wanted:
        err = kernel_support_error(arch, "bfloat16", d, d)
        if err is not None:
            skipped.append((d, err))
            continue
        seqs = sorted(s for dd, s, _ in FULL_CASES if dd == d) or [4096]
        run += [(d, causal, seqs[0]) for causal in (False, True)]
    return run, skipped


def run_child(spec: dict, env_extra: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.update(env_extra)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # jax_fa4's cache alone, not XLA's
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = (p.stderr or p.stdout).strip().splitlines()
    # The exception line of a traceback, else the last lines.
    errs = [ln for ln in lines
            if ln and not ln[0].isspace() and ("Error" in ln or "Exception" in ln)]
    tail = errs[-1:] if errs else lines[-3:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)[-400:]}


def measure(d, causal, seqlen, arch, phases, timeout, log):
    """Rows of one configuration: every phase x step, plus the populate run."""
    heads, batch = HIDDEN // d, TOKENS // seqlen
    base = dict(root=ROOT, arch=arch, hdim=d, causal=causal, seqlen=seqlen, batch=batch,
                heads=heads)
    tmp = tempfile.mkdtemp(prefix="jax_fa4_compile_time_")
    fa4_cache, dsl_cache = os.path.join(tmp, "jax_fa4"), os.path.join(tmp, "dsl")
    fresh = itertools.count()

    def empty_dsl_dir():
        return os.path.join(tmp, f"dsl_empty_{next(fresh)}")

    plan = []  # (phase, step, env)
    if "cold" in phases:
        plan += [("cold", st, {"JAX_FA4_CACHE_DIR": "0", "CUTE_DSL_CACHE_DIR": empty_dsl_dir()})
                 for st in STEPS]
    if "dsl" in phases or "warm" in phases:
        plan.append(("populate", "fwdbwd",
                     {"JAX_FA4_CACHE_DIR": fa4_cache, "CUTE_DSL_CACHE_DIR": dsl_cache}))
    if "dsl" in phases:
        plan += [("dsl", st, {"JAX_FA4_CACHE_DIR": "0", "CUTE_DSL_CACHE_DIR": dsl_cache})
                 for st in STEPS]
    if "warm" in phases:
        plan += [("warm", st, {"JAX_FA4_CACHE_DIR": fa4_cache,
                               "CUTE_DSL_CACHE_DIR": empty_dsl_dir()}) for st in STEPS]
    rows = []
    try:
        for phase, st, env in plan:
            log(f"  hdim {d} causal {causal}: {phase} {st} ...")
            res = run_child(dict(base, step=st), env, timeout)
            row = dict(hdim=d, causal=causal, phase=phase, step=st, seqlen=seqlen, batch=batch,
                       heads=heads, error=res.get("error", ""))
            if "first_s" in res:
                kernels = res["kernels"]
                row.update(
                    first_s=res["first_s"], cute_s=res["cute_s"], second_s=res["second_s"],
                    other_s=res["first_s"] - res["cute_s"] - res["second_s"],
                    import_s=res["import_s"], import_dsl_s=res["import_dsl_s"],
                    n_kernels=len(kernels),
                    kernels=" ".join(f"{k}={v:.3f}" for k, v in kernels.items()),
                )
                log(f"    first {row['first_s']:.2f} s (cute {row['cute_s']:.2f} s: "
                    f"{row['kernels']}), second {row['second_s'] * 1e3:.1f} ms")
            else:
                log(f"    failed: {row['error']}")
            if phase == "populate":
                n = len(os.listdir(fa4_cache)) if os.path.isdir(fa4_cache) else 0
                log(f"    jax_fa4 cache: {n} file(s) in {fa4_cache}")
                if n == 0:
                    row["error"] = (row["error"] + "; " if row["error"] else "") + \
                        "nothing written to the jax_fa4 cache"
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def csv_path(out: str) -> str:
    if out.endswith(".csv"):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        return out
    os.makedirs(out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return os.path.join(out, f"compile_time_{stamp}.csv")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in FIELDS} for r in rows)


def print_table(rows: list[dict]) -> None:
    def cell(r, key):
        return "-" if r is None or r.get(key) in (None, "") else f"{r[key]:.2f}"

    by = {(r["hdim"], r["causal"], r["phase"], r["step"]): r for r in rows}
    cases = sorted({(r["hdim"], r["causal"], r["phase"]) for r in rows if r["phase"] in PHASES},
                   key=lambda c: (c[0], c[1], PHASES.index(c[2])))
    print("\nseconds; first = first call, cute = CuTe DSL compile or jax_fa4 cache load "
          "(bridge.compile_seconds), other = first - cute - second call")
    print(f"{'hdim':>4} {'causal':>6} {'phase':>5} | {'fwd':>6} {'cute':>6} {'other':>6} | "
          f"{'fwd+bwd':>7} {'cute':>6} {'other':>6} | kernels of fwd+bwd (s)")
    for d, causal, phase in cases:
        f, fb = by.get((d, causal, phase, "fwd")), by.get((d, causal, phase, "fwdbwd"))
        errors = [f"{name}: {r['error']}" for name, r in (("fwd", f), ("fwd+bwd", fb))
                  if r is not None and r.get("error")]
        note = "; ".join(errors) if errors else (fb or {}).get("kernels", "")
        print(f"{d:>4} {str(causal):>6} {phase:>5} | {cell(f, 'first_s'):>6} "
              f"{cell(f, 'cute_s'):>6} {cell(f, 'other_s'):>6} | {cell(fb, 'first_s'):>7} "
              f"{cell(fb, 'cute_s'):>6} {cell(fb, 'other_s'):>6} | {note[:60]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out",
                   help="folder for compile_time_DATE.csv (default ./bench_out), or a .csv path")
    p.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--hdims", default="",
                   help="comma-separated head dims (default: those of the benchmark cases)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per process")
    args = p.parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    bad = [x for x in phases if x not in PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {PHASES}")

    arch, why = gpu_arch()
    if arch is None:
        print(f"compile_time: the jax_fa4 kernels need an NVIDIA GPU with a kernel target "
              f"(sm_90a): {why}. Nothing measured.", flush=True)
        return 0
    from jax_fa4.ffi.bridge import cutlass_available

    err = cutlass_available(arch)
    if err is not None:
        print(f"compile_time: {err}; cannot compile the kernels.", flush=True)
        return 1
    hdims = [int(x) for x in args.hdims.split(",") if x] or None
    todo, skipped = configs(arch, hdims)
    print(f"compile_time: {why}; python {sys.version.split()[0]}", flush=True)
    for d, reason in skipped:
        print(f"  hdim {d} skipped: {reason}", flush=True)
    path = csv_path(args.out)
    rows = []
    for i, (d, causal, seqlen) in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] hdim {d} causal {causal} (seqlen {seqlen})", flush=True)
        rows += measure(d, causal, seqlen, arch, phases, args.timeout,
                        lambda m: print(m, flush=True))
        write_csv(path, rows)  # after each configuration: a cut-off run keeps what it measured
    if not rows:
        write_csv(path, rows)
    print_table(rows)
    print(f"csv: {path}", flush=True)
    return 0 if rows and not any(r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
