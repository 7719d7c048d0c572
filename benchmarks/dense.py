"""``python -m benchmarks dense``: the dense layers' matrix products, float32 and bfloat16.

A model built on our layers (the LongNet encoders, LongNetLM) spends about half its
time outside attention, in projections and feed-forward layers: ``[tokens, width] @
[width, out]`` products that XLA compiles. This op times those products on this CPU,
interleaved, in the ways a layer can ask for them, beside PyTorch's (the record carries
``OPENBLAS_CORETYPE``, which holds OpenBLAS to one CPU's kernels):

- ``xla float32``: float32 inputs and result;
- ``xla bfloat16``: bfloat16 inputs and result (what ``dtype=jnp.bfloat16`` layers do);
- ``xla bfloat16, float32 sums``: bfloat16 inputs, ``preferred_element_type=float32``,
  the result rounded to bfloat16 (the layers' route on CPUs with bfloat16 units that
  are not Intel's: ``gemm.bf16_route()``);
- ``xla bfloat16 via float32``: the inputs converted to float32 inside the program;
- ``jax-dilated float32 (OpenBLAS)``: the layers' and models' product
  (:func:`jax_dilated.backends.native.gemm.dot_general`: OpenBLAS's float32 GEMM by an
  FFI call), where it is available;
- ``jax-dilated bfloat16 (OpenBLAS, widened)``: the same with bfloat16 inputs widened
  to float32 and the result rounded back (the layers' route elsewhere without MKL);
- ``jax-dilated bfloat16 (MKL)``: bfloat16 inputs on oneMKL's bfloat16 GEMM (the
  layers' route elsewhere where MKL is installed: ``pip install mkl``);
- ``torch float32`` and ``torch bfloat16`` (oneDNN): PyTorch's ``matmul``.

Where the CPU has no bfloat16 unit (no ``avx512_bf16`` or ``amx_bf16`` flag), torch's
bfloat16 product runs a reference loop about a hundred times slower than float32: it
is then timed once, on a 1024-row product, and reported as such rather than in the
interleaved rounds. XLA's own options (``XLA_FLAGS``, e.g.
``--xla_cpu_use_onednn=true`` where this jaxlib has it) are read at start-up: run the
op once per setting; the record carries ``XLA_FLAGS``.

Shapes: ``--tokens`` rows (default 8192) times ``--width`` (768) into ``--outs``
(768 and 3072: a projection and the first feed-forward layer of the 768-wide encoder).
Inputs are drawn from a normal distribution (never zeros: they run faster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np

from benchmarks import harness
from benchmarks.harness import int_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--outs", type=int_list, default=(768, 3072),
                   help="output widths, one product each (default 768,3072)")
    p.add_argument("--no-torch", action="store_true", help="XLA's variants alone")


def bf16_unit(flags: set[str]) -> str | None:
    """The CPU's bfloat16 matrix unit by its /proc/cpuinfo flags, or None."""
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return None


def xla_variants(x32, w32):
    """{name: () -> result} of XLA's ways to compute x @ w (jitted, inputs on device)."""
    import jax
    import jax.numpy as jnp

    from jax_dilated.backends.native import gemm

    x16, w16 = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    plain = jax.jit(lambda x, w: x @ w)
    blas = jax.jit(lambda x, w: gemm.dot_general(x, w, (((1,), (0,)), ((), ()))))
    f32_sums = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                       .astype(jnp.bfloat16))
    via_f32 = jax.jit(lambda x, w: (x.astype(jnp.float32) @ w.astype(jnp.float32))
                      .astype(jnp.bfloat16))
    calls = {"xla float32": lambda: plain(x32, w32),
            "xla bfloat16": lambda: plain(x16, w16),
            "xla bfloat16, float32 sums": lambda: f32_sums(x16, w16),
            "xla bfloat16 via float32": lambda: via_f32(x16, w16)}
    if gemm.unavailable_reason() is None:
        calls["jax-dilated float32 (OpenBLAS)"] = lambda: blas(x32, w32)
        for library, name in (("openblas", "OpenBLAS, widened"), ("mkl", "MKL")):
            try:
                with gemm.using_bf16(library):  # compiled with that choice, run after
                    compiled = blas.lower(x16, w16).compile()
            except RuntimeError as err:  # MKL not installed
                print(f"jax-dilated bfloat16 ({name}) not timed: {err}")
                continue
            calls[f"jax-dilated bfloat16 ({name})"] = lambda c=compiled: c(x16, w16)
    return calls


@harness.register("dense", "The dense layers' matrix products in float32 and bfloat16: XLA's "
                  "ways against PyTorch's, on this CPU", add_arguments)
def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    if args.quick:
        args.tokens, args.outs = 256, (128,)
    from jax_dilated.backends.native.build import cpu_flags
    unit = bf16_unit(cpu_flags())
    torch = None
    if not args.no_torch:
        try:
            import torch
            torch.set_num_threads(args.threads)
        except ImportError:
            print("torch is not installed: XLA's variants alone")
    rng = np.random.default_rng(0)
    rows = []
    results = []
    for out in args.outs:
        x = rng.standard_normal((args.tokens, args.width), dtype=np.float32)
        w = (rng.standard_normal((args.width, out)) / np.sqrt(args.width)).astype(np.float32)
        calls = xla_variants(jnp.asarray(x), jnp.asarray(w))
        want = x.astype(np.float64) @ w.astype(np.float64)
        errors = {name: harness.max_rel_diff(np.asarray(f(), np.float64), want)["rel_to_max"]
                  for name, f in calls.items()}
        slow_torch_bf16 = None
        if torch is not None:
            tx, tw = torch.from_numpy(x), torch.from_numpy(w)
            calls["torch float32"] = lambda tx=tx, tw=tw: torch.matmul(tx, tw)
            if unit is not None or args.quick:
                tx16, tw16 = tx.bfloat16(), tw.bfloat16()
                calls["torch bfloat16"] = lambda a=tx16, b=tw16: torch.matmul(a, b)
            else:  # one call of a smaller product: its rate, not its place in the rounds
                a16, b16 = tx[:1024].bfloat16(), tw.bfloat16()
                torch.matmul(a16, b16)
                t0 = time.perf_counter()
                torch.matmul(a16, b16)
                seconds = time.perf_counter() - t0
                slow_torch_bf16 = 2 * 1024 * args.width * out / seconds / 1e9
        with torch.inference_mode() if torch is not None else contextlib.nullcontext():
            timings = harness.time_interleaved(calls, repeats=args.repeats, warmup=args.warmup)
        flop = 2 * args.tokens * args.width * out
        for name, t in timings.items():
            rate = flop / t.median / 1e9
            results.append(dict(out=out, variant=name, median_s=t.median, min_s=t.min,
                                spread=t.spread, gflops=rate, max_rel_err=errors.get(name)))
            rows.append([f"{args.tokens}x{args.width}x{out}", name, harness.fmt_ms(t.median),
                         f"{rate:.1f}", harness.fmt_spread(t.spread),
                         "" if name not in errors else f"{errors[name]:.1e}"])
        if slow_torch_bf16 is not None:
            results.append(dict(out=out, variant="torch bfloat16 (1024 rows, one call)",
                                gflops=slow_torch_bf16))
            rows.append([f"1024x{args.width}x{out}", "torch bfloat16 (one call: no bf16 unit)",
                         "", f"{slow_torch_bf16:.1f}", "", ""])
    env = harness.environment(args.threads, args.load)
    env["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    env["bf16_unit"] = unit
    harness.print_table(
        f"dense products ({env['cpu']}; bfloat16 unit: {unit or 'none'}; XLA_FLAGS="
        f"{env['xla_flags']!r}; {args.threads} threads; {env['date_utc']})",
        ["shape", "variant", "ms (median)", "GFLOP/s", "spread", "max rel err"], rows)
    return {"benchmark": "dense", "environment": env, "tokens": args.tokens,
            "width": args.width, "results": results}
