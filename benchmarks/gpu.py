"""``python -m benchmarks gpu``: the kernels on one accelerator.

Usage (on a GPU machine; docs/benchmarks.md has the exact commands)::

    python -m benchmarks gpu                     # n = 16K, 64K, 256K, 1M
    python -m benchmarks gpu --sizes 16384,65536 --ops dilated,segments
    python -m benchmarks gpu --quick --allow-cpu  # tiny sizes, checks the op

Measured per sequence length ``n`` (batch 1, 16 heads, head_dim 128, bfloat16,
segments 2048/4096/8192/16384, rates 1/2/4/8 by default), forward and
forward+backward (the gradient of ``sum(out * g)``), each a jitted function:

``dilated/<mode>``
    ``jd.dilated_attention`` with ``implementation=--implementation`` (default
    None: by device kind), modes head_groups and longnet.
``segments/<mode>``
    Only the kernel calls dilated attention makes: for every branch ``(w, r)`` the
    chosen kernel's differentiable attention on a batch of dense dilated segments
    ``[B n / w, w / r, heads of the branch, D]`` (cut from the inputs inside the
    program; segments are whole: ``n`` a multiple of every ``w``) - no gather,
    scatter or merge. The TFLOP/s ratio dilated / segments is the "at least 70%"
    target.
``ring_device``
    One device's share of a ``--ring-devices`` P ring (default 8) over the whole
    sequence, contiguous layout: ``n / P`` queries of the last device against the
    ``P`` key/value blocks - ``P - 1`` full blocks and the causal diagonal when
    ``--causal`` (every step's mask kind static), merged with
    ``softmax.merge_partials``; the backward as the ring's (``ops/ring.py``): every
    step's kernel backward from the global statistics and output. Communication is
    not included.
``dense``
    Exact attention over the whole sequence through the kernel (cuDNN on a GPU),
    up to ``--dense-max-n`` (default 65536; it is O(n^2)).
``torch/head_groups``
    The PyTorch dilated-attention library's approach
    (``benchmarks/baselines/torch_sdpa.py``: ``F.scaled_dot_product_attention`` per
    dilated segment batch) on the same device (CUDA when available). Its longnet
    mode uses CPU-only aten ops, so on CUDA only head_groups runs.
``variant/<name>`` (``--ops variants``, not in the default set)
    head_groups ``jd.dilated_attention`` plain and with one option each
    (:func:`variant_calls`: a sliding-window branch, soft-capping, sinks, packed rows,
    segments that divide nothing), to compare each with the plain call.

The kernel-only cells (``segments``, ``dense``) differentiate their output alone
(``lse_grad=False``), as dilated attention's own calls do. ``--profile`` traces the
dilated cells (``jax.profiler``) and sums the device's events by kind.

Reported: median time and spread of ``--repeats`` rounds after ``--warmup``, the
cells of one length compiled first and then timed interleaved (:class:`Cells`:
``harness.time_interleaved``; a cell too slow for the rounds is timed alone), tokens/s, achieved TFLOP/s from the attention FLOPs the sparse pattern
needs (``dilated_flops``: ``4 D`` per attended (query, key) pair forward;
forward+backward counted as 3.5x forward, the FlashAttention convention: the
backward's four matmuls plus the recomputed ``QK^T``), compiled memory
(``harness.compiled_memory``) and the device's ``memory_stats`` (bytes in use
before, process peak after). Errors (e.g. out of memory) are recorded per cell.
The table is printed twice: aligned, and as the Markdown table that
docs/benchmarks.md's "## The GPU table" section holds (also written next to the
JSON as ``<json stem>.md``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import subprocess
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import fmt_bytes, fmt_ms, int_list, str_list

DEFAULTS = dict(sizes=(16384, 65536, 262144, 1048576), segments=(2048, 4096, 8192, 16384),
                rates=(1, 2, 4, 8))
QUICK = dict(sizes=(512, 1024), segments=(64, 128, 256, 512), rates=(1, 2, 4, 8))
OPS = ("dilated", "segments", "ring_device", "dense", "torch", "variants")
DEFAULT_OPS = ("dilated", "segments", "ring_device", "dense", "torch")
BACKWARD_FLOP_FACTOR = 3.5  # forward+backward / forward (FlashAttention convention)
HEADERS = ["op", "n", "pass", "ms", "spread", "tokens/s", "TFLOP/s", "temp / torch peak",
           "device peak (process)"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=None,
                   help="sequence lengths (default 16384,65536,262144,1048576; --quick 512,1024)")
    p.add_argument("--segments", type=int_list, default=None,
                   help="segment lengths (default 2048,4096,8192,16384; --quick 64..512)")
    p.add_argument("--rates", type=int_list, default=None, help="dilation rates (1,2,4,8)")
    p.add_argument("--modes", type=str_list, default=("head_groups", "longnet"))
    p.add_argument("--ops", type=str_list, default=DEFAULT_OPS,
                   help=f"subset of {','.join(OPS)} (default {','.join(DEFAULT_OPS)})")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--implementation", default=None,
                   help="kernel for the JAX rows (default: by device kind)")
    p.add_argument("--ring-devices", type=int, default=8)
    p.add_argument("--dense-max-n", type=int, default=65536)
    p.add_argument("--stream-chunk-mib", type=int, default=None,
                   help="CudnnKernel.STREAM_CHUNK_BYTES for this run, in MiB (default: "
                        "the library's): the queries and keys per cuDNN call when "
                        "longnet's differentiated program streams a branch")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--cell-seconds", type=float, default=20.0,
                   help="a cell whose interleaved calls would take longer than this is "
                        "timed alone with as many calls as fit (default 20)")
    p.add_argument("--profile", action="store_true",
                   help="after timing each length, trace the dilated cells' calls with "
                        "jax.profiler and report where the device time goes (kernels "
                        "by name and by kind); the traces are written beside the JSON")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on a machine without a GPU (tiny sizes make sense only)")
    p.add_argument("--seed", type=int, default=0)


# ------------------------------------------------------------------ environment

def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_environment() -> dict:
    """Accelerator facts added to ``harness.environment``: device kind, compute
    capability, nvidia-smi's name/driver/memory, cuDNN, torch's CUDA, and
    ``jd.backend_report()`` (which kernel each implementation resolves to)."""
    import jax

    import jax_dilated as jd
    dev = jax.devices()[0]
    info = {
        "device_kind": dev.device_kind,
        "compute_capability": getattr(dev, "compute_capability", None),
        "platform_version": getattr(dev.client, "platform_version", None),
        "nvidia_smi": _driver(),
    }
    try:
        from jax._src.lib import cuda_versions
        if cuda_versions is not None:
            info["cudnn"] = cuda_versions.cudnn_get_version()
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        import torch
        info["torch_cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    except ImportError:
        pass
    info["kernels"] = [dict(r._asdict()) for r in jd.backend_report(quiet=True)]
    return info


# --------------------------------------------------------------------- helpers

def _ring_device(kernel, num_blocks: int, scale: float, causal: bool):
    """``f(ql, k, v) -> o``: the last of ``num_blocks`` ring devices' queries ``ql``
    against every key block of ``k``/``v``, differentiable as ``jd.ring_attention``
    is (a ``custom_vjp`` whose backward runs each step's kernel backward with the
    global ``lse`` and output: ``Kernel.backward(out=)``, cuDNN's own backward)."""
    import jax
    import jax.numpy as jnp

    from jax_dilated.backends import KernelArgs
    from jax_dilated.core import softmax

    def steps(k, v):
        nl = k.shape[1] // num_blocks
        for s in range(num_blocks):
            blk = slice(s * nl, (s + 1) * nl)
            yield (k[:, blk], v[:, blk],
                   KernelArgs(scale=scale, is_causal=causal and s == num_blocks - 1))

    def fwd(ql, k, v):
        acc = softmax.empty_partial(ql.shape, jnp.float32)
        for kb, vb, step_args in steps(k, v):
            o_s, *lse_s = kernel.forward(ql, kb, vb, step_args)
            acc = softmax.merge_partials(*acc, o_s.astype(jnp.float32), *lse_s)
        o = acc[0].astype(ql.dtype)
        return o, (ql, k, v, o, acc[1], acc[2])

    def bwd(res, do):
        ql, k, v, o, lse, lse_lo = res
        do, delta = softmax.backward_rows(do, o, lse_lo, jnp.zeros_like(lse))
        dq, dks, dvs = 0.0, [], []
        for kb, vb, step_args in steps(k, v):
            dq_s, dk_s, dv_s = kernel.backward(ql, kb, vb, do, lse, delta, step_args, out=o)
            dq, dks, dvs = dq + dq_s.astype(jnp.float32), dks + [dk_s], dvs + [dv_s]
        return (dq.astype(ql.dtype), jnp.concatenate(dks, axis=1),
                jnp.concatenate(dvs, axis=1))

    f = jax.custom_vjp(lambda ql, k, v: fwd(ql, k, v)[0])
    f.defvjp(fwd, bwd)
    return f


def _memory_stats() -> dict | None:
    import jax
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has them
        return None
    if not stats:
        return None
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:300]


class Cells:
    """The cells of one sequence length, compiled one by one and then timed together.

    :meth:`add_jax` compiles a jitted function (its compiled memory recorded) and
    :meth:`add_call` takes any call (torch's, with its own synchronisation); :meth:`run`
    calls each once (a cell that fails, e.g. out of memory, keeps its error and leaves
    the rest), then times all of them in interleaved rounds
    (``harness.time_interleaved``: every cell sees the same state of the device and
    its host) and appends one JSON cell per variant to ``results``. Should a round
    fail, the cells are timed one after another instead (``"interleaved": false``); a
    cell whose first call says its rounds would take over ``--cell-seconds`` is timed
    alone afterwards, with as many calls as fit in that time."""

    def __init__(self, args, results: list[dict]):
        self.args, self.results = args, results
        self.pending: list[tuple[dict, object]] = []

    def add_jax(self, op: str, n: int, pass_name: str, fn, inputs, flops, **extra):
        import time

        import jax
        cell = {"op": op, "n": n, "pass": pass_name, **extra}
        try:
            before = _memory_stats()
            t0 = time.perf_counter()
            memory = harness.compiled_memory(fn, *inputs)
            # the same function and inputs: JAX's cache serves the executable compiled above
            compiled = jax.jit(fn).lower(*inputs).compile()
            cell.update(compile_s=time.perf_counter() - t0, compiled_memory=memory.to_json(),
                        device_memory_before=before, flops=flops)
            self.pending.append((cell, lambda: jax.block_until_ready(compiled(*inputs))))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            self._failed(cell, e)

    def add_call(self, cell: dict, call, flops):
        cell["flops"] = flops
        self.pending.append((cell, call))

    def _failed(self, cell: dict, e: BaseException):
        cell["error"] = _error(e)
        print(f"  {cell['op']:<26} n={cell['n']:<8} {cell.get('pass', '-'):<16} ERROR "
              f"{cell['error']}", flush=True)
        self.results.append(cell)

    def run(self):
        import time
        ready, slow = [], []
        rounds = self.args.warmup + 2 * self.args.repeats  # harness.LEAD_IN = 1 per call
        for cell, call in self.pending:
            try:
                t0 = time.perf_counter()
                call()
                cell["first_call_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - e.g. out of memory
                self._failed(cell, e)
                continue
            # a cell that would take most of the run (e.g. soft-capping on the XLA kernel
            # of a GPU) is timed alone, with as many calls as its share allows
            (slow if cell["first_call_s"] * rounds > self.args.cell_seconds else ready).append(
                (cell, call))
        self.pending = []
        calls = {str(i): call for i, (_, call) in enumerate(ready)}
        try:
            timings = harness.time_interleaved(calls, repeats=self.args.repeats,
                                               warmup=self.args.warmup,
                                               block=lambda result: result)
            interleaved = True
        except Exception:  # noqa: BLE001 - one failed mid-round: one by one instead
            timings, interleaved = {}, False
        for i, (cell, call) in enumerate(ready):
            try:
                timing = timings.get(str(i)) or harness.time_calls(
                    call, repeats=self.args.repeats, warmup=0, block=lambda result: result)
            except Exception as e:  # noqa: BLE001
                self._failed(cell, e)
                continue
            self._timed(cell, timing, interleaved)
        for cell, call in slow:
            count = max(1, int(self.args.cell_seconds / (2 * cell["first_call_s"])))
            try:
                timing = harness.time_calls(call, repeats=count, warmup=0,
                                            block=lambda result: result)
            except Exception as e:  # noqa: BLE001
                self._failed(cell, e)
                continue
            self._timed(cell, timing, False)

    def _timed(self, cell: dict, timing, interleaved: bool):
        cell.update(timing.to_json(), interleaved=interleaved,
                    device_memory_after=_memory_stats())
        if cell.get("flops"):
            _with_rates(cell, cell["flops"], self.args.batch * cell["n"])
        rate = f"{cell['tflops']:8.2f} TFLOP/s" if "tflops" in cell else ""
        print(f"  {cell['op']:<26} n={cell['n']:<8} {cell['pass']:<16} "
              f"{cell['median_s'] * 1e3:10.2f} ms {rate}", flush=True)
        self.results.append(cell)


def _with_rates(res: dict, flops: float, tokens: int) -> dict:
    t = res["median_s"]
    res.update(flops=flops, tflops=flops / t / 1e12, tokens_per_s=tokens / t)
    return res


def branch_runs(heads: int, segments, rates, mode: str) -> list[int]:
    """Per branch, the number of heads that run it (longnet: all; head_groups: the group)."""
    if mode == "longnet":
        return [heads] * len(segments)
    base, extra = divmod(heads, len(segments))
    return [base + (i < extra) for i in range(len(segments))]


# ------------------------------------------------------------------- the runs

@harness.register("gpu", "dilated (both modes), ring (one device's share), its segment "
                         "kernels, dense cuDNN and torch SDPA per segment on one GPU: time, "
                         "tokens/s, TFLOP/s, memory (--quick --allow-cpu checks it without "
                         "a GPU)", add_arguments, repeats=5, quick_repeats=2)
def run(args: argparse.Namespace) -> dict:
    """The ``gpu`` benchmark; returns the JSON-able results."""
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if len(args.segments) != len(args.rates):
        raise SystemExit(f"--segments {args.segments} and --rates {args.rates} differ")
    unknown = set(args.ops) - set(OPS)
    if unknown:
        raise SystemExit(f"--ops: unknown {sorted(unknown)} (choose from {OPS})")

    import jax
    import jax.numpy as jnp

    import jax_dilated as jd
    from benchmarks.dilated import dilated_flops
    from jax_dilated.backends import KernelArgs, get_kernel

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        raise SystemExit(f"no GPU (JAX backend {jax.default_backend()!r}); pass --allow-cpu "
                         f"to check the op with tiny sizes (--quick)")
    b, heads, d = args.batch, args.heads, args.head_dim
    scale = d ** -0.5
    config = {k: getattr(args, k) for k in (
        "sizes", "segments", "rates", "modes", "ops", "batch", "heads", "head_dim", "dtype",
        "causal", "implementation", "ring_devices", "dense_max_n", "repeats", "warmup",
        "no_backward", "quick", "seed", "threads", "profile", "cell_seconds")}
    jd.backend_report()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"device: {jax.devices()[0].device_kind} | driver: {_driver()} | JAX "
          f"{jax.__version__} | {started}", flush=True)

    passes = ("forward",) if args.no_backward else ("forward", "forward_backward")
    results: list[dict] = []
    profiles: list[dict] = []

    def fwd_bwd(f):
        def run(q, k, v, g):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(g.astype(out.dtype))
        return run

    dtype = jnp.dtype(args.dtype)
    if args.stream_chunk_mib is not None:  # a class constant: every cuDNN kernel of the run
        from jax_dilated.backends.cudnn import CudnnKernel
        CudnnKernel.STREAM_CHUNK_BYTES = args.stream_chunk_mib << 20
    kernel = get_kernel(args.implementation)
    kargs = KernelArgs(scale=scale, is_causal=args.causal)

    def kernel_output(q, k, v):
        # only the output is used (and differentiated): lse_grad=False lets cuDNN run
        # its own backward, as dilated attention's calls do
        return kernel.attention(q, k, v, kargs, lse_grad=False)[0]
    for n in args.sizes:
        cells = Cells(args, results)
        shape = (b, n, heads, d)
        # drawn on the device (4 x 4 GiB at n = 1M: host-side numpy would take minutes)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(args.seed), n), 4)
        q, k, v, g = (jax.random.normal(key, shape, dtype) for key in keys)
        segs = tuple(min(w, n) for w in args.segments)
        for mode in args.modes:
            fw = dilated_flops(batch=b, seq_len=n, heads=heads, head_dim=d, segments=segs,
                               rates=args.rates, mode=mode, causal=args.causal)
            flops = {"forward": fw, "forward_backward": BACKWARD_FLOP_FACTOR * fw}
            if "dilated" in args.ops:
                attn = functools.partial(jd.dilated_attention, segment_lengths=segs,
                                         dilation_rates=args.rates, mode=mode,
                                         is_causal=args.causal,
                                         implementation=args.implementation)
                for p in passes:
                    fn = attn if p == "forward" else fwd_bwd(attn)
                    ins = (q, k, v) if p == "forward" else (q, k, v, g)
                    cells.add_jax(f"dilated/{mode}", n, p, fn, ins, flops[p])
            if "segments" in args.ops:
                counts = branch_runs(heads, segs, args.rates, mode)

                def segment_batches(*xs, counts=counts):
                    # per branch, the dense dilated-segment batch a kernel call sees,
                    # cut (inside the program, like the gather) from the inputs
                    for (w, r), hb in zip(zip(segs, args.rates), counts):
                        yield tuple(x[:, :(n // w) * (w // r), :hb].reshape(
                            b * (n // w), w // r, hb, d) for x in xs)

                def segments_fwd(q, k, v):
                    return [kernel_output(sq, sk, sv) for sq, sk, sv in segment_batches(q, k, v)]

                def segments_fwd_bwd(q, k, v, g):
                    outs = []
                    for sq, sk, sv, sg in segment_batches(q, k, v, g):
                        o, vjp = jax.vjp(kernel_output, sq, sk, sv)
                        outs.append((o, vjp(sg)))
                    return outs

                for p in passes:
                    fn = segments_fwd if p == "forward" else segments_fwd_bwd
                    ins = (q, k, v) if p == "forward" else (q, k, v, g)
                    cells.add_jax(f"segments/{mode}", n, p, fn, ins, flops[p])
        if "ring_device" in args.ops:
            P = args.ring_devices
            if n % P:
                print(f"  ring_device n={n}: skipped (n % {P} != 0)")
            else:
                nl = n // P
                ql = q[:, n - nl:]  # the last device's queries
                ring_device = _ring_device(kernel, P, scale, args.causal)

                pairs = nl * nl * (P - 1) + (nl * (nl + 1) // 2 if args.causal else nl * nl)
                fw = 4 * d * heads * b * pairs
                for p in passes:
                    fn = ring_device if p == "forward" else fwd_bwd(ring_device)
                    ins = (ql, k, v) if p == "forward" else (ql, k, v, g[:, n - nl:])
                    cells.add_jax(f"ring_device/P={P}", n, p, fn, ins,
                                  fw if p == "forward" else BACKWARD_FLOP_FACTOR * fw)
        if "dense" in args.ops:
            if n > args.dense_max_n:
                print(f"  dense n={n}: skipped (above --dense-max-n {args.dense_max_n})")
            else:
                dense = kernel_output

                pairs = n * (n + 1) // 2 if args.causal else n * n
                fw = 4 * d * heads * b * pairs
                for p in passes:
                    fn = dense if p == "forward" else fwd_bwd(dense)
                    ins = (q, k, v) if p == "forward" else (q, k, v, g)
                    cells.add_jax("dense", n, p, fn, ins,
                                  fw if p == "forward" else BACKWARD_FLOP_FACTOR * fw)
        if "torch" in args.ops:
            fw = dilated_flops(batch=b, seq_len=n, heads=heads, head_dim=d, segments=segs,
                               rates=args.rates, mode="head_groups", causal=args.causal)
            torch_state = _torch_cells(cells, args, n, segs, passes, fw)
        if "variants" in args.ops:
            _variant_cells(cells, args, n, (q, k, v, g), passes, fwd_bwd)
        cells.run()
        if "torch" in args.ops:
            _torch_release(torch_state)
        if args.profile:
            profiles.extend(_profile(args, n, (q, k, v, g), passes, fwd_bwd))
        del q, k, v, g

    env = harness.environment(args.threads, args.load)
    env.update(gpu_environment())
    payload = {"benchmark": "gpu", "config": config, "environment": env, "results": results}
    if args.profile:
        payload["profiles"] = profiles
    print_summary(payload)
    md = Path(args.json).with_suffix(".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown_table(payload) + "\n")
    print(f"Markdown table for docs/benchmarks.md's \"## The GPU table\" written to {md}")
    return payload


NON_DIVIDING = dict(segments=(1024, 5792, 32768), rates=(1, 2, 4))
SOFT_CAP = 30.0
DOCUMENTS = 8


def variant_calls(args, n: int, heads: int, seed: int) -> dict:
    """``{name: (segments, rates, extra keyword arguments of jd.dilated_attention)}``:
    head_groups dilated attention as timed by ``dilated/head_groups``, plain and with
    one option each: a sliding-window branch in place of the first (``SlidingWindow``
    of half its length each side), soft-capping, attention sinks, packed rows
    (``segment_ids`` of ``DOCUMENTS`` documents of random lengths), and a configuration
    whose segments divide neither the sequence nor each other (``NON_DIVIDING``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_dilated as jd
    segs = tuple(min(w, n) for w in args.segments)
    rng = np.random.default_rng(seed + n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=DOCUMENTS - 1, replace=False))
    ids = np.zeros((args.batch, n), np.int32)
    for c in cuts:
        ids[:, c:] += 1
    sinks = jax.random.normal(jax.random.key(seed + n), (heads,), jnp.float32)
    window = (jd.SlidingWindow(segs[0] // 2),) + segs[1:]
    odd = tuple(min(w, n) for w in NON_DIVIDING["segments"])
    return {
        "plain": (segs, args.rates, {}),
        "window": (window, args.rates, {}),
        "soft_cap": (segs, args.rates, {"logit_soft_cap": SOFT_CAP}),
        "sinks": (segs, args.rates, {"sinks": sinks}),
        "packed": (segs, args.rates, {"segment_ids": jnp.asarray(ids)}),
        "non_dividing": (odd, NON_DIVIDING["rates"], {}),
    }


def _variant_cells(cells: Cells, args, n, qkvg, passes, fwd_bwd) -> None:
    """``variant/<name>`` cells (:func:`variant_calls`), timed with the others of ``n``.
    TFLOP/s only where the pattern is a plain dilated one (plain, non_dividing)."""
    import jax_dilated as jd
    from benchmarks.dilated import dilated_flops
    b, _, heads, d = qkvg[0].shape
    for name, (segs, rates, extra) in variant_calls(args, n, heads, args.seed).items():
        attn = functools.partial(jd.dilated_attention, segment_lengths=segs,
                                 dilation_rates=rates, mode="head_groups",
                                 is_causal=args.causal, implementation=args.implementation,
                                 **extra)
        fw = (dilated_flops(batch=b, seq_len=n, heads=heads, head_dim=d, segments=segs,
                            rates=rates, mode="head_groups", causal=args.causal)
              if name in ("plain", "non_dividing") else None)
        for p in passes:
            fn = attn if p == "forward" else fwd_bwd(attn)
            ins = qkvg[:3] if p == "forward" else qkvg
            flops = None if fw is None else (fw if p == "forward" else BACKWARD_FLOP_FACTOR * fw)
            cells.add_jax(f"variant/{name}", n, p, fn, ins, flops)


PROFILE_CALLS = 3
# kinds of device events, by substrings of their names (lower case), first match wins
EVENT_KINDS = (
    ("attention kernel", ("cudnn", "fmha", "flash", "sdpa", "attention", "custom-call",
                          "custom_call", "sm90", "sm80", "xmma", "cutlass")),
    ("gather / scatter / copy", ("gather", "scatter", "dynamic-update-slice",
                                 "dynamic_update_slice", "dynamic-slice", "dynamic_slice",
                                 "concatenate", "transpose", "copy", "pad", "slice",
                                 "memcpy", "memset", "broadcast")),
    ("reduction / merge", ("reduce", "reduction", "softmax", "exp", "log", "maximum")),
)


def event_kind(name: str) -> str:
    """The kind of a device event by its name (:data:`EVENT_KINDS`; else "other fusion")."""
    low = name.lower()
    for kind, words in EVENT_KINDS:
        if any(w in low for w in words):
            return kind
    return "other fusion"


def summarize_trace(path: str, calls: int) -> dict:
    """A ``*.xplane.pb`` trace's device time (``/device:*`` planes; its lines of XLA
    operations where it has them, else its streams), per call: totals by kind, the 25
    costliest event names, and the count of events (launches)."""
    import collections

    import jax
    data = jax.profiler.ProfileData.from_file(path)
    by_name: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    planes = [pl for pl in data.planes if pl.name.startswith("/device:")]
    line_names = []
    for plane in planes:
        lines = list(plane.lines)
        line_names += [ln.name for ln in lines]
        ops = [ln for ln in lines if ln.name == "XLA Ops"]
        for line in ops or [ln for ln in lines if ln.name not in ("XLA Modules", "Steps")]:
            for ev in line.events:
                by_name[ev.name] += ev.duration_ns
                count[ev.name] += 1
    by_kind: collections.Counter = collections.Counter()
    for name, ns in by_name.items():
        by_kind[event_kind(name)] += ns
    total = sum(by_name.values())
    return {"planes": [pl.name for pl in planes], "lines": line_names,
            "device_ms_per_call": total / calls / 1e6,
            "events_per_call": sum(count.values()) / calls,
            "by_kind_ms": {k: v / calls / 1e6 for k, v in by_kind.most_common()},
            "top_ms": [(name, ns / calls / 1e6, count[name] // calls)
                       for name, ns in by_name.most_common(25)]}


def _profile(args, n, qkvg, passes, fwd_bwd) -> dict:
    """Where the device time of the dilated cells at ``n`` goes: each mode's call traced
    (``jax.profiler``, ``PROFILE_CALLS`` calls after one untraced, the trace kept beside
    the JSON) and summarized (:func:`summarize_trace`)."""
    import glob

    import jax

    import jax_dilated as jd
    out = []
    segs = tuple(min(w, n) for w in args.segments)
    for mode in args.modes:
        attn = functools.partial(jd.dilated_attention, segment_lengths=segs,
                                 dilation_rates=args.rates, mode=mode, is_causal=args.causal,
                                 implementation=args.implementation)
        for p in passes:
            fn = jax.jit(attn if p == "forward" else fwd_bwd(attn))
            ins = qkvg[:3] if p == "forward" else qkvg
            run = {"op": f"dilated/{mode}", "n": n, "pass": p}
            trace_dir = Path(args.json).with_suffix("") / f"trace_{n}_{mode}_{p}"
            try:
                jax.block_until_ready(fn(*ins))
                with jax.profiler.trace(str(trace_dir)):
                    for _ in range(PROFILE_CALLS):
                        jax.block_until_ready(fn(*ins))
                path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
                run.update(summarize_trace(path, PROFILE_CALLS), trace=path)
                print(f"  profile {run['op']} n={n} {p}: {run['device_ms_per_call']:.2f} ms "
                      f"device time per call, {run['events_per_call']:.0f} events; "
                      + ", ".join(f"{k} {v:.2f} ms" for k, v in run["by_kind_ms"].items()),
                      flush=True)
            except Exception as e:  # noqa: BLE001
                run["error"] = _error(e)
                print(f"  profile {run['op']} n={n} {p}: ERROR {run['error']}", flush=True)
            out.append(run)
    return out


def _torch_cells(cells: Cells, args, n, segs, passes, flops_forward: int):
    """The torch SDPA-per-segment baseline (head_groups) at length ``n``, one cell per
    pass, added to ``cells``; returns what :func:`_torch_release` frees afterwards."""
    torch = harness.torch_threads(args.threads)
    if torch is None:
        cells.results.append({"op": "torch/head_groups", "n": n, "error": "torch not installed"})
        return None
    from benchmarks.baselines import torch_sdpa

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, n, args.heads, args.head_dim)
    gen = torch.Generator(device=device).manual_seed(args.seed + n)
    # q, k, v (requiring gradients) and the output cotangent g; cleared afterwards so
    # that empty_cache can give their memory back
    x = {name: torch.randn(shape, generator=gen, device=device, dtype=dtype)
         for name in "qkvg"}
    x["qkv"] = tuple(x[name].requires_grad_(True) for name in "qkv")
    attn = functools.partial(torch_sdpa.head_groups_attention, segment_lengths=segs,
                             dilation_rates=args.rates, is_causal=args.causal)

    def block(result):  # CUDA kernels run asynchronously; CPU torch results are ready
        if device == "cuda":
            torch.cuda.synchronize()
        return result

    def forward():
        with torch.no_grad():
            return block(attn(*x["qkv"]))

    def forward_backward():
        return block(torch.autograd.grad(attn(*x["qkv"]), x["qkv"], grad_outputs=x["g"]))

    torch_cells = []
    for p in passes:
        cell = {"op": f"torch/head_groups ({device})", "n": n, "pass": p}
        try:
            torch_sdpa.check_config(n, segs, args.rates)
        except Exception as e:  # noqa: BLE001
            cells._failed(cell, e)
            continue
        torch_cells.append(cell)
        cells.add_call(cell, forward if p == "forward" else forward_backward,
                       flops_forward if p == "forward"
                       else BACKWARD_FLOP_FACTOR * flops_forward)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return torch, device, x, torch_cells


def _torch_release(state) -> None:
    """Record torch's peak memory on its cells (both passes': they ran interleaved) and
    free its inputs and cache."""
    if state is None:
        return
    torch, device, x, torch_cells = state
    x.clear()
    if device == "cuda":
        for cell in torch_cells:
            cell["torch_peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------ tables

def _rows(payload: dict) -> list[list[str]]:
    rows = []
    for c in payload["results"]:
        mem = (c.get("compiled_memory") or {}).get("temp") if "compiled_memory" in c else \
            c.get("torch_peak_bytes")
        peak = (c.get("device_memory_after") or {}).get("peak_bytes_in_use")
        rows.append([c["op"], str(c["n"]), c.get("pass", "-"),
                     fmt_ms(c.get("median_s")) if "error" not in c else "error",
                     f"{100 * c['spread']:.1f}%" if "spread" in c else "-",
                     f"{c['tokens_per_s']:.3g}" if "tokens_per_s" in c else "-",
                     f"{c['tflops']:.2f}" if "tflops" in c else "-",
                     fmt_bytes(mem), fmt_bytes(peak)])
    return rows


def markdown_table(payload: dict) -> str:
    """The run as the Markdown table of docs/benchmarks.md's "## The GPU table": a
    dated line naming the device, commit and versions, then one ``|`` row per cell
    (notebooks/03_scaling.ipynb prints the ``|`` lines of that section)."""
    env, cfg = payload["environment"], payload["config"]
    lines = [(f"Recorded {env.get('date_utc')} at commit {str(env.get('git_commit'))[:7]}"
             f"{' (dirty)' if env.get('git_dirty') else ''} on {env.get('device_kind')} "
             f"({env.get('nvidia_smi') or 'nvidia-smi unavailable'}), JAX {env.get('jax')}, "
             f"cuDNN {env.get('cudnn', '?')}, torch {env.get('torch') or '-'}: "
             f"`python -m benchmarks gpu` B={cfg['batch']}, {cfg['heads']} heads x "
             f"{cfg['head_dim']}, {cfg['dtype']}, segments {list(cfg['segments'])}, rates "
             f"{list(cfg['rates'])}, causal={cfg['causal']}, median of {cfg['repeats']}."),
             ""]
    warning = env.get("load", {}).get("warning")
    if warning:
        lines += [warning, ""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join("---" for _ in HEADERS) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in _rows(payload)]
    return "\n".join(lines)


# issue 48's targets (forward+backward TFLOP/s against dense cuDNN's; times against torch)
DENSE_SHARE = {"head_groups": 0.80, "longnet": 0.85}
TORCH_FORWARD = 1.1
TORCH_FORWARD_BACKWARD = 2.5


def target_lines(payload: dict) -> list[str]:
    """The targets this run measured, one line each: dilated fwd+bwd TFLOP/s against its
    segment kernels' and dense attention's (same n, same run), torch's time over ours,
    and each ``variant/*`` cell's time over ``variant/plain``'s."""
    by = {(c["op"], c["n"], c.get("pass")): c for c in payload["results"] if "median_s" in c}
    lines = []
    for (op, n, p), c in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        if op.startswith("dilated/") and "tflops" in c:
            mode = op.split("/")[1]
            seg, dense = by.get((f"segments/{mode}", n, p)), by.get(("dense", n, p))
            if p == "forward_backward" and seg:
                lines.append(f"n={n} {mode}: dilated fwd+bwd at {c['tflops'] / seg['tflops']:.0%}"
                             f" of its segment kernels' TFLOP/s")
            if p == "forward_backward" and dense and mode in DENSE_SHARE:
                share = c["tflops"] / dense["tflops"]
                lines.append(f"n={n} {mode}: dilated fwd+bwd at {share:.0%} of dense attention's "
                             f"TFLOP/s (target >= {DENSE_SHARE[mode]:.0%}: "
                             f"{'ok' if share >= DENSE_SHARE[mode] else 'MISSED'})")
            torch_cell = next((t for (o, tn, tp), t in by.items()
                               if o.startswith("torch/") and tn == n and tp == p), None)
            if torch_cell and mode == "head_groups":
                want = TORCH_FORWARD if p == "forward" else TORCH_FORWARD_BACKWARD
                ratio = torch_cell["median_s"] / c["median_s"]
                lines.append(f"n={n} head_groups {p}: torch / ours = {ratio:.2f}x (target >= "
                             f"{want}x: {'ok' if ratio >= want else 'MISSED'})")
        if op.startswith("variant/") and op != "variant/plain":
            plain = by.get(("variant/plain", n, p))
            if plain:
                lines.append(f"n={n} {op} {p}: {c['median_s'] / plain['median_s']:.2f}x the "
                             f"plain call's time")
    return lines


def print_summary(payload: dict) -> None:
    """The cell table and the targets of a ``gpu`` run."""
    env = payload["environment"]
    print()
    harness.print_table(
        f"one accelerator: {env.get('device_kind')} ({env.get('nvidia_smi') or '-'}), commit "
        f"{str(env.get('git_commit'))[:8]}, {env.get('date_utc')}",
        HEADERS, _rows(payload), env=env)
    for line in target_lines(payload):
        print(line)
    for run in payload.get("profiles", []):
        if "error" in run:
            print(f"profile {run['op']} n={run['n']} {run['pass']}: ERROR {run['error']}")
            continue
        print(f"profile {run['op']} n={run['n']} {run['pass']}: "
              f"{run['device_ms_per_call']:.2f} ms of device events per call "
              f"({run['events_per_call']:.0f} events): "
              + ", ".join(f"{k} {v:.2f}" for k, v in run["by_kind_ms"].items()))
        for name, ms, count in run["top_ms"][:8]:
            print(f"    {ms:8.3f} ms  x{count:<4} {name[:100]}")
    print()
    print(markdown_table(payload))
