#!/usr/bin/env python
"""LongNetLM benchmarks: training-step memory/time and KV-cache decoding per token.

Two measurements on one model, a 4-layer, 256-wide LongNetLM (4 heads, xPos,
Sub-LN, the default LongNet branches (2048, 4096, 8192, 16384, 32768) at rates
(1, 2, 4, 8, 16), vocabulary 256):

``train``
    A jitted training step - loss, gradient and an optax AdamW update - on one
    sequence of 8K, 16K and 32K tokens: its compiled temporary memory
    (``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``)
    at each length, and the time of one step at 16K. Target: memory grows linearly,
    32K <= 2.2x 16K.

``decode``
    One cache of 32K + 64 tokens, filled to a context of 4K and to 32K tokens (the
    cache contents random and the index set directly, or with ``--prefill`` by
    running a real prompt through ``model(prompt, decode=True)``), then ~50
    single-token decode steps at each context, interleaved (4K, 32K, 4K, ...), each
    a jitted step that donates the cache. Reports the median per-token time.
    Target: 32K <= 1.5x 4K (per-token work is bounded by the segments, not the
    context).

Usage::

    python scripts/lm_benchmark.py                 # both; JSON to results/lm_benchmark.json
    python scripts/lm_benchmark.py train --lengths 8192,16384,32768
    python scripts/lm_benchmark.py decode --steps 50 --prefill
    python scripts/lm_benchmark.py --quick         # small model and lengths (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_dilated as jd

MEMORY_TARGET = 2.2  # temp(32K) / temp(16K)
DECODE_TARGET = 1.5  # per-token time at 32K / at 4K


def model_config(args) -> jd.models.LongNetConfig:
    return jd.models.LongNetConfig(
        vocab_size=args.vocab, embed_dim=args.width, num_layers=args.layers,
        num_heads=args.heads, segment_lengths=args.segments, dilation_rates=args.rates,
        max_len=args.max_len, remat=args.remat, dtype=jnp.dtype(args.dtype))


def _mib(n: int) -> float:
    return n / 2 ** 20


# ------------------------------------------------------------------------ training


def make_train_step(model, tx):
    """``step(params, opt_state, rest, tokens) -> (params, opt_state, loss)``."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def step(params, opt_state, rest, tokens):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest)
            return jd.models.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), rest


def bench_train(args, progress) -> dict:
    cfg = model_config(args)
    model = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
    tx = optax.adamw(1e-3)
    params = nnx.state(model, nnx.Param)
    opt_state = tx.init(params)
    step, rest = make_train_step(model, tx)
    out = {"lengths": {}, "params": int(sum(x.size for x in jax.tree.leaves(params)))}
    for n in args.lengths:
        tokens = jax.ShapeDtypeStruct((1, n + 1), jnp.int32)
        t0 = time.perf_counter()
        compiled = step.lower(params, opt_state, rest, tokens).compile()
        mem = compiled.memory_analysis()
        row = {"temp_bytes": int(mem.temp_size_in_bytes),
               "temp_mib": round(_mib(mem.temp_size_in_bytes), 1),
               "argument_mib": round(_mib(mem.argument_size_in_bytes), 1),
               "compile_s": round(time.perf_counter() - t0, 1)}
        if n == args.time_length:
            x = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, n + 1)),
                            jnp.int32)
            # donated copies (the model's own buffers stay alive for the next lengths)
            p, o = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state)
            p, o, loss = compiled(p, o, rest, x)  # warm-up
            jax.block_until_ready(loss)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                p, o, loss = compiled(p, o, rest, x)
                jax.block_until_ready(loss)
                times.append(time.perf_counter() - t0)
            row["step_s"] = round(min(times), 3)
            row["step_s_all"] = [round(t, 3) for t in times]
            row["tokens_per_s"] = round(n / min(times), 1)
            del p, o
        out["lengths"][n] = row
        progress(f"train n={n}: temp {row['temp_mib']} MiB"
                 + (f", step {row['step_s']} s" if "step_s" in row else ""))
    lengths = out["lengths"]
    if 16384 in lengths and 32768 in lengths:
        ratio = lengths[32768]["temp_bytes"] / lengths[16384]["temp_bytes"]
        out["temp_ratio_32k_16k"] = round(ratio, 3)
        out["memory_target"] = MEMORY_TARGET
        out["memory_ok"] = ratio <= MEMORY_TARGET
    return out


# ------------------------------------------------------------------------ decoding


def _fill(model, batch, context, max_len, prefill: bool, seed: int):
    """A model whose caches hold ``context`` tokens (of ``max_len``)."""
    model.init_cache(batch, max_len)
    if prefill:
        prompt = jnp.asarray(np.random.default_rng(seed).integers(
            0, model.config.vocab_size, (batch, context)), jnp.int32)
        nnx.jit(lambda m, x: m(x, decode=True)[:, -1])(model, prompt).block_until_ready()
        return model
    rng = np.random.default_rng(seed)
    for block in model.blocks:
        attn = block.attn
        shape, dtype = attn.cached_key.shape, attn.cached_key.dtype
        live = np.arange(shape[1])[None, :, None, None] < context
        for var in (attn.cached_key, attn.cached_value):
            var[...] = jnp.asarray(np.where(live, rng.standard_normal(shape), 0.0), dtype)
        attn.cache_index[...] = jnp.asarray(context, jnp.int32)
    return model


def bench_decode(args, progress) -> dict:
    cfg = model_config(args)
    max_len = max(args.contexts) + args.steps + 8
    model = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
    caches = {}
    t0 = time.perf_counter()
    for i, context in enumerate(args.contexts):
        _fill(model, 1, context, max_len, args.prefill, seed=i)
        graphdef, params, caches[context], rest = nnx.split(model, nnx.Param, nnx.Cache, ...)
    fill_s = time.perf_counter() - t0

    def one_token(params, cache, rest, token):
        m = nnx.merge(graphdef, params, cache, rest)
        logits = m(token, decode=True, deterministic=True)[:, -1]
        return nnx.state(m, nnx.Cache), jnp.argmax(logits, -1).astype(jnp.int32)[:, None]

    step = jax.jit(one_token, donate_argnums=1)  # the cache is updated in place
    token = {c: jnp.zeros((1, 1), jnp.int32) for c in args.contexts}
    for c in args.contexts:  # compile (one program for every context) and warm up
        caches[c], token[c] = step(params, caches[c], rest, token[c])
        jax.block_until_ready(token[c])
    times = {c: [] for c in args.contexts}
    for _ in range(args.steps):
        for c in args.contexts:  # interleaved
            t0 = time.perf_counter()
            caches[c], token[c] = step(params, caches[c], rest, token[c])
            jax.block_until_ready(token[c])
            times[c].append(time.perf_counter() - t0)
    out = {"max_len": max_len, "steps": args.steps, "prefill": args.prefill,
           "fill_s": round(fill_s, 1), "contexts": {}}
    for c in args.contexts:
        med = statistics.median(times[c])
        out["contexts"][c] = {"median_ms": round(1e3 * med, 3),
                              "min_ms": round(1e3 * min(times[c]), 3),
                              "p90_ms": round(1e3 * float(np.percentile(times[c], 90)), 3)}
        progress(f"decode context {c}: {1e3 * med:.2f} ms/token (median of {args.steps})")
    lo, hi = min(args.contexts), max(args.contexts)
    ratio = statistics.median(times[hi]) / statistics.median(times[lo])
    out[f"ratio_{hi}_{lo}"] = round(ratio, 3)
    out["decode_target"] = DECODE_TARGET
    out["decode_ok"] = ratio <= DECODE_TARGET
    return out


# ----------------------------------------------------------------------------- main


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("all", "train", "decode"), default="all")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--segments", type=_ints, default=(2048, 4096, 8192, 16384, 32768))
    p.add_argument("--rates", type=_ints, default=(1, 2, 4, 8, 16))
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat", action="store_true", help="rematerialise every block")
    p.add_argument("--lengths", type=_ints, default=(8192, 16384, 32768))
    p.add_argument("--time-length", type=int, default=16384,
                   help="the length whose training step is timed")
    p.add_argument("--repeats", type=int, default=2, help="timed training steps")
    p.add_argument("--contexts", type=_ints, default=(4096, 32768))
    p.add_argument("--steps", type=int, default=50, help="decode steps per context")
    p.add_argument("--prefill", action="store_true",
                   help="fill the caches by a real prompt pass (slow at 32K on CPU)")
    p.add_argument("--quick", action="store_true", help="tiny model and lengths")
    p.add_argument("--json", default=os.path.join("results", "lm_benchmark.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.segments, args.rates = 2, 64, (256, 512), (1, 2)
        args.lengths, args.time_length, args.contexts = (512, 1024, 2048), 1024, (256, 2048)
        args.steps, args.max_len, args.repeats = 10, 2048, 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)

    def progress(msg):
        print(f"[lm_benchmark] {msg}", file=sys.stderr, flush=True)

    result = {"config": {k: v for k, v in vars(args).items() if k != "json"},
              "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "cpu_count": os.cpu_count(), "jax": jax.__version__,
              "python": platform.python_version()}
    if args.what in ("all", "train"):
        result["train"] = bench_train(args, progress)
    if args.what in ("all", "decode"):
        result["decode"] = bench_decode(args, progress)

    print("\nLongNetLM benchmark "
          f"({args.layers} layers, width {args.width}, {result['device']})")
    if "train" in result:
        tr = result["train"]
        print(f"  training step (loss + grad + AdamW), {tr['params']} parameters:")
        for n, row in tr["lengths"].items():
            extra = f", one step {row['step_s']} s" if "step_s" in row else ""
            print(f"    {n:>6} tokens: temp memory {row['temp_mib']:>9.1f} MiB{extra}")
        if "temp_ratio_32k_16k" in tr:
            print(f"    temp(32K)/temp(16K) = {tr['temp_ratio_32k_16k']:.2f} "
                  f"(target <= {MEMORY_TARGET}: {'ok' if tr['memory_ok'] else 'MISSED'})")
    if "decode" in result:
        de = result["decode"]
        print(f"  KV-cache decoding, one cache of {de['max_len']} tokens, "
              f"{de['steps']} steps per context:")
        for c, row in de["contexts"].items():
            print(f"    context {c:>6}: {row['median_ms']:.2f} ms/token (median)")
        key = next(k for k in de if k.startswith("ratio_"))
        print(f"    ratio = {de[key]:.2f} (target <= {DECODE_TARGET}: "
              f"{'ok' if de['decode_ok'] else 'MISSED'})")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"  results: {args.json}")
    return result


if __name__ == "__main__":
    main()
