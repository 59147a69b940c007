"""How a compiled CuTe DSL kernel becomes an XLA custom call.

This is the only module that knows about `cutlass.jax`. It compiles a kernel
once per `KernelKey` with dynamic batch / sequence / head extents and emits a
`jax.ffi.ffi_call` to the CuTe DSL runtime's FFI target carrying the compiled
object. `cutlass.jax.cutlass_call` would re-enter `cute.compile` for every new
argument shape (its cache is keyed by shapes); here the key is the kernel
configuration alone, so a training loop with varying sequence lengths compiles
each configuration once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_fa4.config import KernelKey

logger = logging.getLogger("jax_fa4")

_lock = threading.Lock()
_compiled: dict[tuple, Any] = {}
compile_seconds: dict[KernelKey, float] = {}
_poison = threading.local()


@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
    """Testing aid: kernels lowered inside this context write into NaN-filled buffers.

    Every output a kernel writes is passed in as a NaN-filled input aliased to
    that output, so an element the kernel forgets to write stays NaN. The
    kernel sees the same arguments either way.
    """
    old = getattr(_poison, "on", False)
    _poison.on = enabled
    try:
        yield
    finally:
        _poison.on = old


def cutlass_available(arch: str | None = None) -> str | None:
    """None if nvidia-cutlass-dsl's JAX bridge imports, else why not.

    ``arch``, when given, is exported as CUTE_DSL_ARCH before a first import.
    """
    if arch is not None and "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_ARCH"] = arch
    try:
        import cutlass.jax as cj  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return f"nvidia-cutlass-dsl is not importable ({type(e).__name__}: {e})"
    if not cj.is_available():
        return "nvidia-cutlass-dsl's JAX extensions are not available"
    return None


@contextlib.contextmanager
def pinned_arch(arch: str):
    """Make the DSL compile for ``arch`` inside the block, then restore its target.

    The DSL reads CUTE_DSL_ARCH when its singleton is built (at the first
    cutlass import) and otherwise detects the GPU, defaulting silently to
    sm_100a without one. Set the variable for a first import, and the
    singleton's target for the case where cutlass was imported earlier. (Its
    `--gpu-arch` compile option is no substitute: with it the host object fails
    to export.)
    """
    saved_env = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = arch
    from cutlass.cutlass_dsl.cutlass import CuTeDSL  # no public setter exists

    envar = CuTeDSL._get_dsl().envar
    saved_arch = envar.arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = saved_arch
        if saved_env is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = saved_env


def _specs(structs: Sequence[Any], static_dims: Sequence[Sequence[int]]):
    from cutlass.jax import TensorSpec

    specs = []
    for s, static in zip(structs, static_dims, strict=True):
        # Explicit divisibility 1 keeps batch / sequence / head extents dynamic:
        # without it the bridge would assume the first call's concrete extents.
        div = tuple(int(s.shape[i]) if i in static else 1 for i in range(len(s.shape)))
        specs.append(TensorSpec(divisibility=div))
    return tuple(specs)


def _canonical(struct: Any, static: Sequence[int]) -> jax.ShapeDtypeStruct:
    # The binary must not depend on the first call's extents: compile against
    # placeholder extents of 1 on every dynamic dimension.
    shape = tuple(int(d) if i in static else 1 for i, d in enumerate(struct.shape))
    return jax.ShapeDtypeStruct(shape, struct.dtype)


def compile_kernel(
    key: KernelKey,
    build: Callable[[], Any],
    in_structs: Sequence[Any],
    out_structs: Sequence[Any],
    in_static: Sequence[Sequence[int]],
    out_static: Sequence[Sequence[int]],
    aliases: Mapping[int, int],
) -> Any:
    """Compile (once per key and call frame) and return the bridge's compile result."""
    frame = (key, len(in_structs), len(out_structs), tuple(sorted(aliases.items())))
    with _lock:
        hit = _compiled.get(frame)
    if hit is not None:
        return hit
    import cutlass.jax.compile as cjc  # the bridge's compile entry (public module)

    ins = [_canonical(s, st) for s, st in zip(in_structs, in_static, strict=True)]
    outs = [_canonical(s, st) for s, st in zip(out_structs, out_static, strict=True)]
    in_specs = _specs(ins, in_static)
    out_specs = _specs(outs, out_static)
    in_tree = jax.tree.structure(tuple(range(len(ins))))
    out_tree = jax.tree.structure(tuple(range(len(outs))))

    spec = _build_spec(cjc, ins, in_tree, outs, out_tree, in_specs, out_specs, aliases, key)
    t0 = time.perf_counter()
    path = _disk_path(frame)
    result = _disk_load(path)
    if result is not None:
        dt = time.perf_counter() - t0
        logger.info("jax_fa4: loaded %s from %s in %.3f s", key, path, dt)
    else:
        with _lock, pinned_arch(key.arch):
            compiled = cjc.get_or_compile_kernel(build(), spec, compile_key=("jax_fa4", key))
        result = Compiled(compiled.module, compiled.fingerprint)
        dt = time.perf_counter() - t0
        logger.info("jax_fa4: compiled %s in %.2f s", key, dt)
        _disk_store(path, result)
    with _lock:
        _compiled[frame] = result
        compile_seconds[key] = dt
    return result


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compiled kernel as the FFI target takes it: host object and its digest."""

    module: bytes
    fingerprint: bytes


# On-disk cache of compiled kernels, so a second process skips cute.compile.
# $JAX_FA4_CACHE_DIR sets the folder ("" or "0" turns the cache off); the
# default is ~/.cache/jax_fa4. Entries are keyed by the kernel key, the call
# frame, and a digest of the kernel sources and tool versions, so an edited
# kernel or a new DSL never loads a stale binary.
CACHE_ENV = "JAX_FA4_CACHE_DIR"


def cache_dir() -> str | None:
    """The compiled-kernel cache folder, or None when caching is off."""
    d = os.environ.get(CACHE_ENV)
    if d is None:
        d = os.path.join(os.path.expanduser("~"), ".cache", "jax_fa4")
    return None if d in ("", "0") else d


@functools.cache
def _sources_digest() -> str:
    import cutlass
    import cutlass.jax as cj

    h = hashlib.sha256()
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Everything a compiled kernel depends on: its sources, the launch plan that
    # builds it from its key, and the constants in config.py.
    paths = [os.path.join(pkg, "config.py")]
    for sub in ("kernels", "ffi", "rules"):
        folder = os.path.join(pkg, sub)
        paths += [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".py")]
    for path in paths:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    versions = (
        getattr(cutlass, "__version__", "?"),
        jax.__version__,
        cj.get_cutlass_call_ffi_version(),
    )
    h.update(repr(versions).encode())
    return h.hexdigest()


def _disk_path(frame: tuple) -> str | None:
    d = cache_dir()
    if d is None:
        return None
    name = hashlib.sha256((repr(frame) + _sources_digest()).encode()).hexdigest()[:40]
    return os.path.join(d, f"{name}.o")


def _disk_load(path: str | None) -> Compiled | None:
    if path is None or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        module = f.read()
    return Compiled(module, hashlib.sha256(module).digest())


def _disk_store(path: str | None, result: Compiled) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(result.module)
        os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    except OSError as e:
        logger.warning("jax_fa4: could not write the kernel cache %s: %s", path, e)


def _build_spec(cjc, ins, in_tree, outs, out_tree, in_specs, out_specs, aliases, key):
    # build_function_spec type-checks inputs as jax.Array; the placeholders we
    # compile against are ShapeDtypeStructs, so build the Arg records directly.
    in_args = tuple(
        cjc.Arg(i, tuple(s.shape), np.dtype(s.dtype), sp)
        for i, (s, sp) in enumerate(zip(ins, in_specs, strict=True))
    )
    out_args = tuple(
        cjc.Arg(i, tuple(s.shape), np.dtype(s.dtype), sp)
        for i, (s, sp) in enumerate(zip(outs, out_specs, strict=True))
    )
    aliased_outputs = set(aliases.values())
    kernel_out_tree = jax.tree.structure(
        tuple(i for i in range(len(outs)) if i not in aliased_outputs)
    )
    return cjc.FunctionSpec(
        in_args=in_args,
        input_tree=in_tree,
        out_args=out_args,
        output_tree=kernel_out_tree,
        input_output_aliases=tuple(sorted(aliases.items())),
        input_spec=tuple(in_specs),
        output_spec=tuple(out_specs),
        compile_options=None,
        use_static_tensors=False,
        kwargs=(),
    )


def kernel_call(
    key: KernelKey,
    build: Callable[[], Any],
    inputs: Sequence[jax.Array],
    out_structs: Sequence[jax.ShapeDtypeStruct],
    *,
    in_static: Sequence[Sequence[int]],
    out_static: Sequence[Sequence[int]],
    aliases: Mapping[int, int] | None = None,
) -> tuple[jax.Array, ...]:
    """Call the kernel of ``key`` on ``inputs``; returns the outputs.

    Args:
      key: the compile key; `build()` makes the kernel object on a cache miss.
      inputs / out_structs: row-major operands and result shapes.
      in_static / out_static: per tensor, the dimensions that are compile-time
        constants (head dims); every other extent is read at run time.
      aliases: input index -> output index sharing a buffer (updated in place).
    """
    import cutlass.jax as cj

    aliases = dict(aliases or {})
    inputs, in_static = list(inputs), list(in_static)
    if getattr(_poison, "on", False):
        for i, (st, static) in enumerate(zip(out_structs, out_static, strict=True)):
            if i not in aliases.values():
                aliases[len(inputs)] = i
                inputs.append(jax.numpy.full(st.shape, jax.numpy.nan, st.dtype))
                in_static.append(static)
    result = compile_kernel(
        key, build, inputs, out_structs, in_static, out_static, aliases
    )
    cj.register_ffi()
    target = cj.get_cutlass_call_ffi_name(True, cj.get_cutlass_call_ffi_version())
    call = jax.ffi.ffi_call(
        target,
        result_shape_dtypes=tuple(out_structs),
        input_output_aliases=aliases,
    )
    return tuple(call(*inputs, module=result.module, key=result.fingerprint))
