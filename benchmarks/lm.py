"""``python -m benchmarks lm``: LongNetLM training-step memory/time and decoding per token.

Two measurements on one model, a 4-layer, 256-wide LongNetLM (4 heads, xPos,
Sub-LN, the default LongNet branches (2048, 4096, 8192, 16384, 32768) at rates
(1, 2, 4, 8, 16), vocabulary 256):

``train``
    A jitted training step - loss, gradient and an optax AdamW update - on one
    sequence of 8K, 16K and 32K tokens: its compiled temporary memory
    (``harness.compiled_memory``) at each length, and the time of one step at 16K
    (``--time-length``; median of ``--repeats`` steps, default 2). Target: memory
    grows linearly, 32K <= 2.2x 16K.

``decode``
    One cache of 32K + 64 tokens, filled to a context of 4K and to 32K tokens (the
    cache contents random and the index set directly, or with ``--prefill`` by
    running a real prompt through ``model(prompt, decode=True)``), then ``--steps``
    (default 50) single-token decode steps at each context, interleaved
    (``harness.time_interleaved``: one step of every context per round, rotating
    order), each a jitted step that donates the cache. Reports the median per-token
    time. Target: 32K <= 1.5x 4K (per-token work is bounded by the segments, not the
    context).

``python -m benchmarks lm`` runs both; ``lm train`` or ``lm decode`` one of them;
``--quick`` a tiny model and lengths (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks import harness
from benchmarks.harness import int_list

MEMORY_TARGET = 2.2  # temp(32K) / temp(16K)
DECODE_TARGET = 1.5  # per-token time at 32K / at 4K


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", choices=("all", "train", "decode"), default="all",
                   help="which measurement (default all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--segments", type=int_list, default=(2048, 4096, 8192, 16384, 32768))
    p.add_argument("--rates", type=int_list, default=(1, 2, 4, 8, 16))
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat", action="store_true", help="rematerialise every block")
    p.add_argument("--lengths", type=int_list, default=(8192, 16384, 32768))
    p.add_argument("--time-length", type=int, default=16384,
                   help="the length whose training step is timed (--repeats steps)")
    p.add_argument("--contexts", type=int_list, default=(4096, 32768))
    p.add_argument("--steps", type=int, default=50,
                   help="decode steps per context: the interleaved rounds of the decode "
                        "timing (default 50)")
    p.add_argument("--prefill", action="store_true",
                   help="fill the caches by a real prompt pass (slow at 32K on CPU)")


def _resolve(args: argparse.Namespace) -> None:
    if args.quick:  # a tiny model and lengths: checks the op end to end
        args.layers, args.width, args.segments, args.rates = 2, 64, (256, 512), (1, 2)
        args.lengths, args.time_length, args.contexts = (512, 1024, 2048), 1024, (256, 2048)
        args.steps, args.max_len = 10, 2048
    if len(args.segments) != len(args.rates):
        raise SystemExit(f"--segments {args.segments} and --rates {args.rates} differ")


def model_config(args):
    import jax.numpy as jnp

    import jax_dilated as jd
    return jd.models.LongNetConfig(
        vocab_size=args.vocab, embed_dim=args.width, num_layers=args.layers,
        num_heads=args.heads, segment_lengths=args.segments, dilation_rates=args.rates,
        max_len=args.max_len, remat=args.remat, dtype=jnp.dtype(args.dtype))


# ------------------------------------------------------------------------ training

def make_train_step(model, tx):
    """``step(params, opt_state, rest, tokens) -> (params, opt_state, loss)`` (not jitted)
    and the model's non-parameter state ``rest``."""
    import jax
    import optax
    from flax import nnx

    import jax_dilated as jd
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def step(params, opt_state, rest, tokens):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest)
            return jd.models.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, rest


def bench_train(args, progress: harness.Progress) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_dilated as jd
    cfg = model_config(args)
    model = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
    tx = optax.adamw(1e-3)
    params = nnx.state(model, nnx.Param)
    opt_state = tx.init(params)
    step, rest = make_train_step(model, tx)
    out = {"lengths": {}, "params": int(sum(x.size for x in jax.tree.leaves(params)))}
    for n in args.lengths:
        progress.start(f"train n={n}: compile" + (", time" if n == args.time_length else ""))
        tokens = jax.ShapeDtypeStruct((1, n + 1), jnp.int32)
        t0 = time.perf_counter()
        mem = harness.compiled_memory(step, params, opt_state, rest, tokens,
                                      donate_argnums=(0, 1))
        row = {"temp_bytes": mem.temp, "temp_mib": round(mem.temp / 2 ** 20, 1),
               "argument_mib": round(mem.argument / 2 ** 20, 1), "memory": mem.to_json(),
               "compile_s": round(time.perf_counter() - t0, 1)}
        if n == args.time_length:
            # the same jit and arguments: served from JAX's cache, not compiled again
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
                params, opt_state, rest, tokens).compile()
            x = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, n + 1)),
                            jnp.int32)
            # donated copies (the model's own buffers stay alive for the next lengths)
            state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state)]

            def one_step():
                state[0], state[1], loss = compiled(state[0], state[1], rest, x)
                return loss

            timing = harness.time_calls(one_step, repeats=args.repeats, warmup=args.warmup)
            row["step"] = timing.to_json()
            row["step_s"] = round(timing.median, 3)
            row["tokens_per_s"] = round(n / timing.median, 1)
            del state
        out["lengths"][n] = row
        progress.done()
        progress.write(f"train n={n}: temp {row['temp_mib']} MiB"
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
    import jax.numpy as jnp
    from flax import nnx
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


def bench_decode(args, progress: harness.Progress) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_dilated as jd
    cfg = model_config(args)
    # room for the warm-up and timed tokens after the longest context
    max_len = max(args.contexts) + args.steps + args.warmup + 8
    model = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
    caches = {}
    progress.start(f"decode: fill caches to {','.join(map(str, args.contexts))}")
    t0 = time.perf_counter()
    for i, context in enumerate(args.contexts):
        _fill(model, 1, context, max_len, args.prefill, seed=i)
        graphdef, params, caches[context], rest = nnx.split(model, nnx.Param, nnx.Cache, ...)
    fill_s = time.perf_counter() - t0
    progress.done()

    def one_token(params, cache, rest, token):
        m = nnx.merge(graphdef, params, cache, rest)
        logits = m(token, decode=True, deterministic=True)[:, -1]
        return nnx.state(m, nnx.Cache), jnp.argmax(logits, -1).astype(jnp.int32)[:, None]

    step = jax.jit(one_token, donate_argnums=1)  # the cache is updated in place
    token = {c: jnp.zeros((1, 1), jnp.int32) for c in args.contexts}

    def decode_at(c):
        def call():
            caches[c], token[c] = step(params, caches[c], rest, token[c])
            return token[c]
        return call

    progress.start(f"decode: {args.steps} interleaved steps per context")
    # one program for every context (the cache has one size); compiled by the warm-up
    timings = harness.time_interleaved({str(c): decode_at(c) for c in args.contexts},
                                       repeats=args.steps, warmup=max(args.warmup, 1))
    progress.done()
    out = {"max_len": max_len, "steps": args.steps, "prefill": args.prefill,
           "fill_s": round(fill_s, 1), "contexts": {}}
    for c in args.contexts:
        t = timings[str(c)]
        out["contexts"][c] = {"median_ms": round(1e3 * t.median, 3),
                              "min_ms": round(1e3 * t.min, 3),
                              "p90_ms": round(1e3 * float(np.percentile(t.samples, 90)), 3),
                              "spread": round(t.spread, 4), "timing": t.to_json()}
        progress.write(f"decode context {c}: {1e3 * t.median:.2f} ms/token "
                       f"(median of {args.steps})")
    lo, hi = min(args.contexts), max(args.contexts)
    ratio = statistics.median(timings[str(hi)].samples) / statistics.median(
        timings[str(lo)].samples)
    out[f"ratio_{hi}_{lo}"] = round(ratio, 3)
    out["paired_ratio"] = round(harness.paired_ratio(timings[str(hi)], timings[str(lo)]), 3)
    out["decode_target"] = DECODE_TARGET
    out["decode_ok"] = ratio <= DECODE_TARGET
    return out


# ----------------------------------------------------------------------------- run

@harness.register("lm", "LongNetLM: training-step memory and time, KV-cache decoding time "
                        "per token at a short and a long context", add_arguments,
                  repeats=2, quick_repeats=1)
def run(args: argparse.Namespace) -> dict:
    """The ``lm`` benchmark; returns the JSON-able results."""
    _resolve(args)
    config = {k: v for k, v in vars(args).items()
              if k not in ("json", "load", "no_plot")}
    progress = harness.Progress(
        (len(args.lengths) if args.what in ("all", "train") else 0)
        + (2 if args.what in ("all", "decode") else 0), "lm")
    progress.write(f"lm: {args.layers} layers, width {args.width}, {args.heads} heads, "
                   f"segments {args.segments}, rates {args.rates}, threads {args.threads}")
    result: dict = {"benchmark": "lm", "config": config}
    if args.what in ("all", "train"):
        result["train"] = bench_train(args, progress)
    if args.what in ("all", "decode"):
        result["decode"] = bench_decode(args, progress)
    progress.close()
    result["environment"] = harness.environment(args.threads, args.load)
    print_summary(result)
    return result


def print_summary(result: dict, file=None) -> None:
    cfg, env = result["config"], result["environment"]
    file = sys.stdout if file is None else file
    print(f"\nLongNetLM benchmark ({cfg['layers']} layers, width {cfg['width']}, "
          f"{cfg['heads']} heads; {env.get('cpu') or env.get('jax_devices')}, "
          f"{cfg['threads']} threads, commit {str(env.get('git_commit'))[:8]}, "
          f"{env.get('date_utc')})\n", file=file)
    if "train" in result:
        tr = result["train"]
        rows = [[str(n), f"{row['temp_mib']:.1f}", f"{row['argument_mib']:.1f}",
                 "-" if "step" not in row else f"{row['step']['median_s']:.3f}",
                 "-" if "step" not in row else f"{100 * row['step']['spread']:.1f}%",
                 "-" if "tokens_per_s" not in row else f"{row['tokens_per_s']:.0f}"]
                for n, row in tr["lengths"].items()]
        harness.print_table(
            f"training step (loss + grad + AdamW), {tr['params']} parameters",
            ["tokens", "temp MiB", "args MiB", "step s (median)", "spread", "tokens/s"],
            rows, env=env, file=file)
        if "temp_ratio_32k_16k" in tr:
            print(f"temp(32K)/temp(16K) = {tr['temp_ratio_32k_16k']:.2f} "
                  f"(target <= {MEMORY_TARGET}: {'ok' if tr['memory_ok'] else 'MISSED'})\n",
                  file=file)
    if "decode" in result:
        de = result["decode"]
        rows = [[str(c), f"{row['median_ms']:.2f}", f"{row['min_ms']:.2f}",
                 f"{row['p90_ms']:.2f}", f"{100 * row['spread']:.1f}%"]
                for c, row in de["contexts"].items()]
        harness.print_table(
            f"KV-cache decoding, one cache of {de['max_len']} tokens, {de['steps']} "
            f"interleaved steps per context",
            ["context", "ms/token (median)", "min", "p90", "spread"], rows, env=env, file=file)
        key = next(k for k in de if k.startswith("ratio_"))
        print(f"ratio = {de[key]:.2f} (paired {de['paired_ratio']:.2f}; target <= "
              f"{DECODE_TARGET}: {'ok' if de['decode_ok'] else 'MISSED'})", file=file)
