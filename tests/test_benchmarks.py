"""The benchmark harness (benchmarks/harness.py) and the dilated op's baselines.

No peer is needed: the torch baselines are skipped without torch, tokamax without
tokamax. The baselines are compared with ``jd.dilated_attention`` on random float32
inputs (output and the gradient of a random-weighted sum) at 1e-5 relative to the
largest magnitude, in both modes, causal and not.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import XLA_CPU_MEMORY

import jax_dilated as jd
from benchmarks import dilated, harness
from benchmarks.baselines import jax_per_segment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-5
# uneven head groups (5 heads, 3 branches), a rate larger than some groups' heads
B, N, H, D = 2, 64, 5, 8
CFG = {"segment_lengths": (8, 16, 32), "dilation_rates": (1, 2, 4)}
MODES = ("head_groups", "longnet")


# ------------------------------------------------------------------------- timing

def test_time_interleaved_rotates_the_order_and_blocks_every_call():
    log, blocked = [], []

    def call(name):
        def fn():
            log.append(name)
            return name
        return fn

    timings = harness.time_interleaved({n: call(n) for n in "abc"}, repeats=4, warmup=1,
                                       block=blocked.append, lead_in=0)
    assert log == list("abc" "abc" "bca" "cab" "abc")  # warm-up, then rotating rounds
    assert blocked == log
    log.clear()
    blocked.clear()
    # by default each timed call comes right after an untimed call of the same variant
    harness.time_interleaved({n: call(n) for n in "ab"}, repeats=2, warmup=0,
                             block=blocked.append)
    assert log == list("aabb" "bbaa")
    assert blocked == log
    assert set(timings) == set("abc")
    assert all(len(t.samples) == 4 and min(t.samples) >= 0 for t in timings.values())
    with pytest.raises(ValueError, match="repeats"):
        harness.time_interleaved({"a": call("a")}, repeats=0)


def test_time_calls_blocks_jax_results_by_default():
    x = jnp.arange(4.0, dtype=jnp.float32)
    t = harness.time_calls(lambda: x * 2, repeats=3, warmup=0)
    assert len(t.samples) == 3


def test_timing_statistics():
    t = harness.Timing([3.0, 1.0, 2.0, 10.0])
    assert t.median == 2.5 and t.min == 1.0 and t.max == 10.0
    assert t.spread == pytest.approx((10.0 - 1.0) / 2.5)
    assert t.iqr == pytest.approx(np.percentile(t.samples, 75) - np.percentile(t.samples, 25))
    js = t.to_json()
    assert js["median_s"] == 2.5 and js["samples_s"] == [3.0, 1.0, 2.0, 10.0]
    assert js["spread"] == pytest.approx(3.6)
    with pytest.raises(ValueError):
        harness.Timing([])


def test_paired_ratio_is_the_median_of_per_round_ratios():
    a, b = harness.Timing([2.0, 4.0, 6.0]), harness.Timing([1.0, 1.0, 2.0])
    assert harness.paired_ratio(a, b) == 3.0           # ratios 2, 4, 3
    with pytest.raises(ValueError, match="same rounds"):
        harness.paired_ratio(a, harness.Timing([1.0]))


# --------------------------------------------------------------------------- load

def _loads(*values):
    it = iter(values)

    def getloadavg():
        value = next(it)
        if isinstance(value, Exception):
            raise value
        return (value, value, value)
    return getloadavg


def _no_proc():  # a platform without /proc/stat: the end's load average decides
    return None


def test_load_monitor_counts_other_processes_not_its_own_threads():
    # 10 s of run: the machine busy 14 CPU-seconds, 12 of them this process's own
    clock = iter([(100.0, 5.0), (114.0, 17.0)])
    load = harness.LoadMonitor(2, getloadavg=_loads(0.3, 1.9),
                               busy_seconds=lambda: next(clock))
    load._start = (load._start[0] - 10.0, load._start[1])
    load.stop()
    assert load.after[0] == 1.9  # the run's own threads, recorded but not held against it
    assert load.others == pytest.approx(0.2, abs=0.01) and load.quiet
    clock = iter([(100.0, 5.0), (129.0, 17.0)])  # 17 CPU-seconds of others in 10 s
    load = harness.LoadMonitor(2, getloadavg=_loads(0.3, 1.9),
                               busy_seconds=lambda: next(clock))
    load._start = (load._start[0] - 10.0, load._start[1])
    load.stop()
    assert not load.quiet and "1.70" in load.warning()


def test_load_monitor_quiet_run_has_no_warning():
    load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(0.3, 0.9))
    load.stop()
    assert load.before[0] == 0.3 and load.after[0] == 0.9
    assert load.quiet and load.warning() is None


@pytest.mark.parametrize("before,after,worst", [(0.3, 1.7, 1.7), (2.5, 0.2, 2.5),
                                                (1.0, 0.1, 1.0)])
def test_load_monitor_warns_above_half_the_cores(before, after, worst):
    load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(before, after))
    load.stop()
    assert not load.quiet
    warning = load.warning()
    assert warning.startswith("WARNING") and f"{worst:.2f}" in warning
    assert "half of 2 cores" in warning and "not publishable" in warning
    # every table of the run carries it, given the LoadMonitor or the environment's record
    for env in (load, {"load": load.to_json()}):
        out = io.StringIO()
        harness.print_table("t", ["a", "b"], [["1", "22"]], env=env, file=out)
        assert warning in out.getvalue()


def test_load_monitor_threshold_follows_the_pinned_cores_and_missing_load():
    load = harness.LoadMonitor(8, busy_seconds=_no_proc, getloadavg=_loads(3.9, 3.9))
    load.stop()
    assert load.quiet
    load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(OSError(), OSError()))
    load.stop()
    assert not load.quiet and "unavailable" in load.warning()
    # not stopped: the load now stands in for the end of the run
    load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(0.1, 0.2, 1.5))
    out = io.StringIO()
    harness.print_table("t", ["a"], [["1"]], env=load, file=out)
    assert "WARNING" not in out.getvalue() and load.after is None
    assert "1.50" in load.warning()


def test_environment_records_machine_versions_commit_and_load():
    load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(0.2, 0.4))
    env = harness.environment(2, load)
    for key in ("date_utc", "cpu", "logical_cores", "threads", "python", "platform", "jax",
                "jaxlib", "jax_backend", "jax_devices", "torch", "peers", "git_commit",
                "git_dirty", "load"):
        assert key in env, key
    assert env["jax"] == jax.__version__ and env["threads"] == 2
    assert env["load"]["before_1_5_15"][0] == 0.2 and env["load"]["after_1_5_15"][0] == 0.4
    assert env["load"]["quiet"] and env["load"]["warning"] is None
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
    assert env["date_utc"].endswith("Z")


def test_cpu_description_names_family_model_and_vector_unit():
    """Two VMs both called "AMD EPYC" are told apart (family, model, AVX-512 or AVX2),
    and the bfloat16 units are named."""
    block = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
             "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n\n"
             "processor\t: 1\ncpu family\t: 99\nmodel name\t: other\n")
    assert harness.cpu_description(block) == "AMD EPYC (family 25, model 17, AVX-512)"
    older = block.replace(" avx512f avx512bw", "").replace("25", "23")
    assert harness.cpu_description(older) == "AMD EPYC (family 23, model 17, AVX2)"
    xeon = block.replace("avx512bw", "avx512bw avx512_bf16 amx_bf16 amx_tile")
    assert harness.cpu_description(xeon) == (
        "AMD EPYC (family 25, model 17, AVX-512, AVX512-BF16, AMX-BF16)")
    assert harness.cpu_description("model name\t: Some CPU\n") == "Some CPU"
    assert harness.cpu_description("processor\t: 0\n") is None


def test_pin_threads_and_light_imports_in_a_fresh_process():
    code = ("import os, sys; from benchmarks.harness import pin_threads; "
            "heavy = [m for m in ('jax', 'torch', 'matplotlib') if m in sys.modules]; "
            "n = pin_threads(1); "
            "print(n, len(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'], heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip().split(maxsplit=3)
    assert out == ["1", "1", "1", "[]"]


# ------------------------------------------------------------------------- memory

@XLA_CPU_MEMORY
def test_compiled_memory_against_hand_computed_buffers():
    """Two sorts whose [256, 256] float32 results are live together (1 row is returned):
    the temp buffers hold at least both (2 x 256 KiB); argument and output are exact."""
    def fn(x):
        y = jnp.sort(x, axis=0)
        z = jnp.sort(y * 2 + 1, axis=1)
        return jnp.sort(z + y, axis=0)[0]

    full = 256 * 256 * 4
    spec = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    stats = harness.compiled_memory(fn, spec)
    assert stats.argument == full and stats.output == 256 * 4
    assert stats.temp >= 2 * full
    assert harness.temp_bytes(fn, jnp.ones((256, 256), jnp.float32)) == stats.temp
    assert stats.to_json()["temp"] == stats.temp


# ---------------------------------------------------------------- options, flops

def test_registered_op_gets_the_common_options():
    op = harness.OPS["dilated"]
    parser = argparse.ArgumentParser()
    op.add_arguments(parser)
    harness.add_common_arguments(parser, op)
    for argv, repeats in (([], 7), (["--quick"], 3), (["--repeats", "5"], 5)):
        args = parser.parse_args(argv)
        harness.resolve_common(args, op)
        assert args.repeats == repeats and args.threads == 2
    args = parser.parse_args(["--causal"])
    assert args.causal == "yes"
    assert parser.parse_args([]).causal == "both"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_flops_count_the_allowed_pairs(mode, causal):
    """4 D flops per (query, key) pair the selection rule of docs/semantics.md allows."""
    n, h, segs, rates = 40, 5, (8, 16, 64), (1, 2, 4)   # a short last segment, w > n
    p = np.arange(n)
    pairs = 0
    groups = [(0, 2), (2, 4), (4, 5)]
    for i, (w, r) in enumerate(zip(segs, rates)):
        heads = range(*groups[i]) if mode == "head_groups" else range(h)
        for j in heads:
            o = i % r if mode == "head_groups" else j % r
            sel = (p % w) % r == o
            ok = sel[:, None] & sel[None, :] & (p[:, None] // w == p[None, :] // w)
            if causal:
                ok &= p[None, :] <= p[:, None]
            pairs += int(ok.sum())
    assert dilated.dilated_flops(batch=3, seq_len=n, heads=h, head_dim=D, segments=segs,
                                 rates=rates, mode=mode, causal=causal) == 3 * 4 * D * pairs


# ----------------------------------------------------------------------- baselines

@functools.cache
def _inputs():
    """q, k, v and the weights c of the loss sum(out * c): [B, N, H, D] float32."""
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((B, N, H, D)).astype(np.float32) for _ in range(4))


def _jax_result(fn):
    """Output and gradient of sum(fn(q, k, v) * c), in one compiled program."""
    def both(q, k, v, c):
        out = fn(q, k, v)
        return out, jax.grad(lambda *a: jnp.sum(fn(*a) * c), argnums=(0, 1, 2))(q, k, v)

    out, grads = jax.jit(both)(*(jnp.asarray(x, jnp.float32) for x in _inputs()))
    return np.asarray(out), [np.asarray(g) for g in grads]


@functools.cache
def _reference(mode, causal):
    return _jax_result(lambda q, k, v: jd.dilated_attention(q, k, v, mode=mode,
                                                            is_causal=causal, **CFG))


def _assert_close(got, want, what):
    assert got.dtype == np.float32 and got.shape == want.shape, what
    err = np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want))
    assert err < RTOL, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_torch_sdpa_baseline_matches_jax_dilated(mode, causal):
    torch = pytest.importorskip("torch")
    from benchmarks.baselines import torch_sdpa
    inputs = _inputs()
    want_out, want_grads = _reference(mode, causal)
    q, k, v = (torch.tensor(x, requires_grad=True) for x in inputs[:3])
    out = torch_sdpa.dilated_attention(q, k, v, mode=mode, is_causal=causal, **CFG)
    grads = torch.autograd.grad(out, (q, k, v), grad_outputs=torch.tensor(inputs[3]))
    _assert_close(out.detach().numpy(), want_out, "output")
    for name, g, w in zip("qkv", grads, want_grads):
        _assert_close(g.numpy(), w, f"d{name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_jax_per_segment_baseline_matches_jax_dilated(mode, causal):
    want_out, want_grads = _reference(mode, causal)
    exact_grads = mode == "head_groups" or jax_per_segment.lse_has_gradient()
    out, grads = _jax_result(lambda q, k, v: jax_per_segment.dilated_attention(
        q, k, v, mode=mode, is_causal=causal, **CFG))
    _assert_close(out, want_out, "output")
    if exact_grads:
        for name, g, w in zip("qkv", grads, want_grads):
            _assert_close(g, w, f"d{name}")
    else:
        # jax.nn's log-sum-exp carries no gradient here, so the branch mixing weights are
        # constants to autodiff and the gradient is not LongNet's: why the op times the
        # longnet forward only
        assert np.max(np.abs(grads[0] - want_grads[0])) > 1e-3 * np.max(np.abs(want_grads[0]))


@pytest.mark.parametrize("causal", [False, True])
def test_tokamax_per_segment_baseline_matches_jax_dilated(causal):
    pytest.importorskip("tokamax")
    from benchmarks.baselines import tokamax_per_segment
    want_out, want_grads = _reference("head_groups", causal)
    out, grads = _jax_result(lambda q, k, v: tokamax_per_segment.dilated_attention(
        q, k, v, mode="head_groups", is_causal=causal, **CFG))
    _assert_close(out, want_out, "output")
    for name, g, w in zip("qkv", grads, want_grads):
        _assert_close(g, w, f"d{name}")
    with pytest.raises(NotImplementedError, match="log-sum-exp"):
        tokamax_per_segment.dilated_attention(*(jnp.asarray(x) for x in _inputs()[:3]),
                                              mode="longnet", **CFG)


def test_per_segment_baselines_reject_configurations_they_cannot_run():
    with pytest.raises(ValueError, match="seq_len % segment"):
        jax_per_segment.check_config(60, (8, 16), (1, 2))
    with pytest.raises(ValueError, match="differ in length"):
        jax_per_segment.check_config(64, (8, 16), (1,))


@pytest.mark.parametrize("causal", [False, True])
def test_xformers_shim_is_softmax_attention(causal):
    """The CPU stand-in for xformers.ops.memory_efficient_attention ([B, L, H, D])."""
    torch = pytest.importorskip("torch")
    from benchmarks.baselines import dilated_attention_pytorch as dap
    dap.install_xformers_shim()
    import xformers.ops as xops
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 12, 3, 8)) for _ in range(3))
    bias = xops.LowerTriangularMask() if causal else None
    got = xops.memory_efficient_attention(*(torch.tensor(x, dtype=torch.float64)
                                            for x in (q, k, v)), attn_bias=bias).numpy()
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    if causal:
        s = np.where(np.tril(np.ones((12, 12), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ packed (issue 17)

def _op_args(name: str, argv: list[str]):
    """The registered op ``name`` and ``argv`` parsed as ``python -m benchmarks name``
    parses it (the op's own options and the common ones)."""
    op = harness.OPS[name]
    parser = argparse.ArgumentParser()
    op.add_arguments(parser)
    harness.add_common_arguments(parser, op)
    return op, parser.parse_args(argv)


def _run_on_a_loaded_machine(op, args, targets_title: str):
    """Run ``op`` with ``args`` while the load average reads 1.5 on 2 cores: its payload,
    after checking that the table printed the targets and the load warning."""
    harness.resolve_common(args, op)
    args.load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(1.5, 1.5))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        payload = op.run(args)
    text = out.getvalue()
    assert targets_title in text and "WARNING: load average 1.50" in text
    return payload


def test_dilated_op_times_longnet_unshared_beside_it(tmp_path):
    """``python -m benchmarks dilated --unshared`` at a tiny size: longnet's set times
    jax-dilated with each branch computing all its pairs beside the default (shared
    pairs), the two agree, and only programs traced inside the switch drop shared
    pairs (the native kernel's attribute in the lowered program)."""
    import functools

    import jax
    import jax.numpy as jnp

    import jax_dilated as jd
    from benchmarks import dilated
    from jax_dilated.backends import native
    op, args = _op_args("dilated", [
        "-n", "256", "--segments", "64,128", "--rates", "1,2", "--heads", "2",
        "--head-dim", "16", "--modes", "longnet", "--causal", "no", "--peers", "none",
        "--unshared", "--memory-seq-lens", "", "--matmul-batches", "1", "--repeats",
        "1", "--warmup", "0", "--no-plot", "--json", str(tmp_path / "d.json")])
    harness.resolve_common(args, op)
    args.load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(0.1, 0.1))
    with contextlib.redirect_stdout(io.StringIO()):
        payload = op.run(args)
    (run,) = payload["runs"]
    assert set(run["variants"]) == {dilated.JAX_DILATED, dilated.UNSHARED}
    assert run["checks"][dilated.UNSHARED]["agree"]
    assert run["variants"][dilated.UNSHARED]["forward_backward"]["over_jax_dilated"] > 0
    # the attribute is the native kernel's, which implementation=None picks only where
    # the default device is a CPU (on a GPU it is cuDNN, with no such attribute; the
    # kernel is chosen from jax.devices()[0], whatever device a program is lowered for)
    if native.unavailable_reason() is None and jax.default_backend() == "cpu":
        x = jax.ShapeDtypeStruct((1, 256, 2, 16), jnp.float32)
        def lowered():  # a new function each time: jit's cache would keep the first trace
            return jax.jit(functools.partial(jd.dilated_attention, segment_lengths=(64, 128),
                                             dilation_rates=(1, 2))).lower(x, x, x).as_text()

        with dilated._each_branch_all_pairs():
            assert "shared_pairs = false" in lowered()
        assert "shared_pairs = true" in lowered()


def test_packed_op_runs_end_to_end_at_a_tiny_size(tmp_path):
    """``python -m benchmarks packed`` in this process at a tiny size: every part runs,
    packed results equal the documents run alone, the ring's executed work is what the
    skip rules give, and the targets and the load warning are printed."""
    from benchmarks import packed
    op, args = _op_args("packed", [
        "-n", "64", "--documents", "4", "--devices", "2", "--heads", "2", "--head-dim",
        "4", "--block", "8", "--layouts", "zigzag", "--modes", "longnet",
        "--segment-lengths", "16", "--dilation-rates", "2", "--no-forward", "--repeats",
        "1", "--warmup", "0", "--json", str(tmp_path / "p.json")])
    payload = _run_on_a_loaded_machine(op, args, "issue 17 targets")
    assert payload["benchmark"] == "packed" and "environment" in payload
    for part in ("ring", "block_sparse"):
        for res in payload[part]["variants"].values():
            assert res["forward_backward"]["median_s"] > 0
            assert res["memory_forward_backward"]["temp"] >= 0
            check = next((v for k, v in res.items() if k.startswith("check_vs_")), None)
            assert check is None or check["agree"], check
    for res in payload["dilated"]["longnet"]["variants"].values():
        assert res["check_vs_batched"]["agree"] and "forward" not in res
    # 4 documents of 16 over 2 devices, zigzag chunks of 16 = one document each (and one
    # kernel block): only the 2 diagonal steps run, one block per chunk in each
    work = payload["ring"]["work"]["packed zigzag"]
    assert (work["steps_run"], work["blocks_run"], work["block"]) == (2, 4, 16)
    assert payload["ring"]["work"]["one document zigzag"]["steps_run"] == 4
    names = [t["target"] for t in payload["targets"]]
    assert all(isinstance(t["pass"], bool) for t in payload["targets"])
    assert any("ring packed zigzag: fwd+bwd time" in t for t in names)
    assert not any("forward time" in t for t in names)  # --no-forward: not timed
    assert packed.ring_work(None, 64, 2, "contiguous", True)["steps_run"] == 3


# ------------------------------------------------------ window (issue 18)

def test_window_op_runs_end_to_end_at_a_tiny_size(tmp_path):
    """``python -m benchmarks window`` in this process at a tiny size: every part runs and
    every variant agrees with the dense masked reference (and jax.nn's local window);
    the block cover, the ring's executed work (by hand) and a lying variant's check."""
    from benchmarks import window
    op, args = _op_args("window", [
        "--ring-seq-len", "32", "--ring-window", "8", "--devices", "2",
        "--local-seq-len", "32", "--local-window", "8", "--block", "4", "--cap-seq-len",
        "32", "--heads", "2", "--head-dim", "4", "--check-seq-len", "32",
        "--no-forward", "--repeats", "1", "--warmup", "0", "--lead-in", "0", "--json",
        str(tmp_path / "w.json")])
    payload = _run_on_a_loaded_machine(op, args, "issue 18 targets")
    assert payload["benchmark"] == "window" and "environment" in payload
    for part in ("ring", "local", "softcap"):
        checks = payload[part]["check"]["variants"]
        assert set(checks) == set(payload[part]["variants"])
        for name, check in checks.items():
            assert check["agree"] and check["seq_len"] == 32, (part, name, check)
        for res in payload[part]["variants"].values():
            assert res["forward_backward"]["median_s"] > 0 and "forward" not in res
            assert res["memory_forward_backward"]["temp"] >= 0
    assert "jax.nn local_window_size" in payload["ring"]["check"]["variants"]["ring, window"]
    # window 8 of blocks of 4: LocalWindow(2, 0) (checked at the timed size, n=32)
    assert payload["local"]["cover"]["pattern"] == "LocalWindow(2, 0)"
    assert (payload["local"]["check"]["window"], payload["local"]["check"]["block"]) == (8, 4)
    assert window._scaled(4096, 1024, 65536) == 64
    assert window.cover((1000, 0), 512) == (2, 0) and window.cover((1025, 3), 512) == (3, 1)
    names = [t["target"] for t in payload["targets"]]
    assert any(t.startswith("ring window 8: forward+backward") for t in names)
    assert all(isinstance(t["pass"], bool) for t in payload["targets"])
    # the ring: device d computes shards d and d - 1 only; blocks of 512 within
    # 8 blocks of the window: 108 on the diagonal step (136 causal), 36 on the step before
    w = window.ring_work(65536, 8, "contiguous", 4096)
    full = window.ring_work(65536, 8, "contiguous", None)
    assert (w["steps_run"], w["blocks_run"]) == (15, 108 + 7 * (108 + 36))
    assert (full["steps_run"], full["blocks_run"]) == (36, 8 * 136 + 28 * 256)
    # the softcap check's inputs are bent by the cap: ignoring it would fail the check
    amp = payload["softcap"]["check"]["query_amplitude"]
    assert amp == window.cap_amplitude(50.0) == 25.0
    rng = np.random.default_rng(2)
    q, k, v, ct = (rng.standard_normal((1, 16, 2, 4)) for _ in range(4))
    capped, plain = (window.dense_reference(amp * q, k, v, ct, scale=0.5, causal=True,
                                            soft_cap=c)[0] for c in (50.0, None))
    assert np.max(np.abs(capped - plain)) > 100 * window.CHECK_RTOL["float32"]
    # a variant that does not compute what it claims fails its check
    liar = window.Variant(functools.partial(jax.nn.dot_product_attention, is_causal=True),
                          {"causal": True, "window": (3, 0)}, jnp.asarray)
    rng = np.random.default_rng(1)
    host = [rng.standard_normal((1, 16, 2, 4), dtype=np.float32) for _ in range(4)]
    assert not window.check_variants({"liar": liar}, host, args)["liar"]["agree"]


def test_dense_op_times_every_variant_and_checks_them(tmp_path):
    """``python -m benchmarks dense --quick`` in this process: XLA's four ways, the
    models' BLAS product and torch's two (both timed with --quick, whatever the CPU)
    are timed; XLA's and the BLAS's results agree with the float64 product to
    float32's / bfloat16's precision; the record
    names XLA_FLAGS and the CPU's bfloat16 unit (flags by name)."""
    from benchmarks import dense
    op, args = _op_args("dense", ["--quick", "--repeats", "1", "--warmup", "0",
                                  "--json", str(tmp_path / "d.json")])
    harness.resolve_common(args, op)
    args.load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(0.1, 0.1))
    with contextlib.redirect_stdout(io.StringIO()):
        payload = op.run(args)
    got = {r["variant"]: r for r in payload["results"]}
    xla = [n for n in got if n.startswith("xla")]
    assert len(xla) == 4 and {"torch float32", "torch bfloat16"} <= set(got)
    assert all(got[n]["median_s"] > 0 and got[n]["gflops"] > 0 for n in got)
    assert got["xla float32"]["max_rel_err"] < 1e-5
    assert all(got[n]["max_rel_err"] < 2e-2 for n in xla)
    from jax_dilated.backends.native import gemm
    if gemm.unavailable_reason() is None:  # (tests/test_dense_products.py says why not)
        assert got["jax-dilated float32 (OpenBLAS)"]["max_rel_err"] < 1e-5
        assert got["jax-dilated bfloat16 (OpenBLAS, widened)"]["max_rel_err"] < 2e-2
        if gemm._mkl()[2] is None:  # MKL installed
            assert got["jax-dilated bfloat16 (MKL)"]["max_rel_err"] < 2e-2
    assert "xla_flags" in payload["environment"] and "bf16_unit" in payload["environment"]
    assert dense.bf16_unit({"avx512f", "avx512_bf16"}) == "AVX512-BF16"
    assert dense.bf16_unit({"avx512_bf16", "amx_bf16", "amx_tile"}) == "AMX-BF16"
    assert dense.bf16_unit({"avx2", "fma"}) is None


# ------------------------------------------------------ strategies (issue 19)

def test_strategies_op_runs_end_to_end_at_a_tiny_size(tmp_path, capsys, monkeypatch):
    """``python -m benchmarks strategies`` in this process at a tiny size: every strategy
    compiles, is timed and has its memory, and so does the per-branch mix the cost model
    offers (on a pretended GPU, 4 heads over 8 devices: the longest branch's 8 devices
    cannot split 4 heads, so it gathers, the middle one exchanges heads among its 2),
    and the step counter counts every step it announces."""
    from benchmarks import strategies as bench
    from jax_dilated.ops.strategies import cost

    monkeypatch.setattr(cost, "_device_kind", lambda: "gpu")
    op, args = _op_args("strategies", [
        "--ops", "dilated", "--seq-lens", "256", "--kv-heads", "4", "--devices", "8",
        "--heads", "4", "--head-dim", "8", "--repeats", "1", "--warmup", "0", "--json",
        str(tmp_path / "s.json"), "--no-plot"])
    harness.resolve_common(args, op)
    args.load = harness.LoadMonitor(2, busy_seconds=_no_proc, getloadavg=_loads(0.1, 0.1))
    payload = op.run(args)
    (row,) = payload["rows"]
    assert row["auto"] == "ring+heads+allgather"
    assert set(row["strategies"]) == {"ring", "allgather", "heads", bench.MIX, "auto"}
    for name, entry in row["strategies"].items():
        if name == "heads":  # 4 heads over 8 devices: refused, with the reason
            assert entry["estimate"]["reason"] and "memory" not in entry
            continue
        assert entry["memory"]["total"] > 0 and entry["fwd_bwd"]["median_s"] > 0, name
    err = capsys.readouterr().err
    total = int(re.search(r"\[strategies\] (\d+) steps", err).group(1))
    steps = [int(k) for k, n in re.findall(r"\[(\d+)/(\d+)\]", err)]
    assert steps == list(range(1, total + 1)) and total == 7, (steps, total)


# ------------------------------------------------------------ slide (issue 49)

def test_slide_op_runs_end_to_end_at_a_tiny_size(tmp_path, monkeypatch):
    """``python -m benchmarks slide --quick`` in this process at a tiny size: the PyTorch
    comparison skips without ``--gigapath-src`` and says why, the compiled memory is
    measured at every tile count, the sharded model (a child process with 2 simulated
    devices) equals one device with less memory per device, the forward of run100k (a
    child process) completes with its peak RSS, and the targets and the load warning
    are printed."""
    from benchmarks import slide
    if jax.default_backend() != "cpu":
        # the children on the CPU: the mesh child's one-device model would otherwise run
        # on the GPU (TF32 products: 5e-4 from the CPU devices' sharded model, against a
        # 1e-5 target), the simulated devices being CPUs
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    op, args = _op_args("slide", [
        "--quick", "--memory-tiles", "32,64", "--devices", "2", "--mesh-tiles", "48",
        "--run-tiles", "100", "--json", str(tmp_path / "s.json"), "--no-plot"])
    payload = _run_on_a_loaded_machine(op, args, "issue 49 targets")
    assert payload["benchmark"] == "slide" and "environment" in payload
    assert "--gigapath-src" in payload["time"]["skipped"]
    mem = payload["memory"]
    assert set(mem["tiles"]) == {32, 64}
    assert all(row["temp_bytes"] > 0 for row in mem["tiles"].values())
    mesh = mem["mesh"]
    if "skipped" not in mesh:  # the mesh path may refuse (it then says why)
        assert mesh["check"]["agree"], mesh
        assert mesh["per_device"]["temp_bytes"] < mesh["one_device"]["temp_bytes"], mesh
        assert mesh["target"] == slide.mesh_target(2) == 1.0 and slide.mesh_target(8) == 0.25
    run = payload["run100k"]
    assert "error" not in run, run
    assert run["output_finite"] and run["peak_rss_bytes"] > 0 and run["tiles"] == 100
    names = [t["target"] for t in payload["targets"]]
    assert any(n.startswith("memory: temp per tile") for n in names)
    assert not any(n.startswith("time:") for n in names)


def test_gigapath_stand_in_attention_is_softmax_attention_with_its_lse():
    """The flash-attn stand-in the PyTorch peer of ``slide`` runs: torchscale's signature,
    [b, l, h, d] in and out, the natural log-sum-exp [b, h, l] of the scaled logits."""
    torch = pytest.importorskip("torch")
    from benchmarks.baselines import gigapath
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 4, generator=gen) for _ in range(3))
    for causal in (False, True):
        out, lse = gigapath.cpu_flash_attn_func(q, k, v, 0.0, None, None, causal)
        logits = torch.einsum("blhd,bmhd->bhlm", q, k) / 2.0
        if causal:
            logits = logits.masked_fill(torch.ones(7, 7).triu(1).bool(), float("-inf"))
        want = torch.einsum("bhlm,bmhd->blhd", logits.softmax(-1), v)
        assert out.shape == (2, 7, 3, 4) and lse.shape == (2, 3, 7)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, logits.logsumexp(-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="dropout"):
        gigapath.cpu_flash_attn_func(q, k, v, 0.1)
    assert "--gigapath-src" in gigapath.available(None)
    assert "not a checkout" in gigapath.available(os.fspath(ROOT))


@pytest.mark.skipif(not os.environ.get("JD_GIGAPATH_SRC"),
                    reason="set JD_GIGAPATH_SRC to a checkout of prov-gigapath/prov-gigapath "
                           "to compare with its PyTorch slide encoder")
def test_slide_op_matches_prov_gigapath_when_given_its_checkout(tmp_path):
    """With Prov-GigaPath's code at hand: ``slide time --quick`` in a fresh process (its
    stand-in modules stay out of this one) builds its module, and ours with the same
    weights gives the same slide embeddings."""
    import json
    out = tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "slide", "time", "--quick", "--repeats", "1",
         "--gigapath-src", os.environ["JD_GIGAPATH_SRC"], "--json", str(out), "--no-plot"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    timing = json.loads(out.read_text())["time"]
    assert "skipped" not in timing, timing
    assert timing["check"]["agree"], timing["check"]
