"""The real cuDNN primitive, bound and lowered for CUDA on a machine without a GPU.

``jax.eval_shape`` binds this JAX's private fused-attention primitives by abstract
evaluation, and ``jax.export`` lowers for the ``cuda`` platform from a CPU machine
without running anything, so a change in those private signatures (jax 0.12 added
``score_mod_args`` and ``score_mod`` to the backward) or in what the backend asks of
cuDNN (the float32 statistics, the widened backward, a sliding window's
``sliding_window_length``) is caught before any GPU session. Needs no torch, so CI
runs it on both JAX versions. The cuDNN version probe, which needs CUDA, is stubbed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jax_dilated as jd
from jax_dilated.backends import KernelArgs, cudnn, registry, selection

H100 = selection.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", (9, 0), "cuda")


@pytest.fixture(autouse=True)
def _cudnn_version(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as fused
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)


def test_real_primitive_binds_abstractly():
    """The real cuDNN forward and backward bind with this JAX's primitives: shapes and dtypes
    by abstract evaluation (no lowering, so no GPU needed; the cuDNN version probe, which
    needs CUDA, is stubbed). Catches a changed private signature before a GPU session."""
    assert cudnn.primitive_signature_reason() is None
    ops = cudnn.CudnnOps()
    b, t, s, h, hkv, d = 2, 64, 48, 4, 2, 64
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16)
    o, stats = jax.eval_shape(lambda q, k, v: ops.forward(q, k, v, scale=0.125, causal=False),
                              q, kv, kv)
    assert (o.shape, o.dtype) == ((b, t, h, d), jnp.bfloat16)
    assert (stats.shape, stats.dtype) == ((b, h, t), jnp.float32)
    grads = jax.eval_shape(
        lambda q, k, v, o, st, do: ops.backward(q, k, v, o, st, do, scale=0.125, causal=True),
        q, kv, kv, q, jax.ShapeDtypeStruct((b, h, t), jnp.float32), q)
    assert [(g.shape, g.dtype) for g in grads] == [
        ((b, t, h, d), jnp.bfloat16), ((b, s, hkv, d), jnp.bfloat16),
        ((b, s, hkv, d), jnp.bfloat16)]
    # and the whole kernel (forward, widened backward) traces with it
    kern = cudnn.CudnnKernel(ops=ops, device=H100)
    args = KernelArgs(scale=0.125)

    def loss(q, k, v):
        o, lse, _ = kern.attention(q, k, v, args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    shapes = jax.eval_shape(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    assert [x.shape for x in shapes] == [(b, t, h, d), (b, s, hkv, d), (b, s, hkv, d)]


def _cuda_custom_calls(fn, *shapes):
    """``[(target, signature, line)]`` of the cuDNN custom calls in ``fn`` lowered for CUDA
    (from this CPU machine: jax.export lowers for another platform without running
    anything); ``line`` is the call's whole line, the backend config's JSON quotes
    (written ``\\22`` in MLIR) as ``"``."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(n)
              for n in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")]
    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*shapes)
    calls = []
    for line in exp.mlir_module().splitlines():
        m = re.search(r"custom_call @(__cudnn\S+)\(", line)
        if m:
            calls.append((m.group(1), line[line.rindex(" : ("):], line.replace("\\22", '"')))
    return calls


@pytest.mark.parametrize("with_lse", [True, False])
def test_lowers_to_cudnn_for_cuda(with_lse):
    """The real primitive path lowered for CUDA: one fused forward returning float32 stats,
    one fused backward - widened to head_dim + 8 when the lse has a cotangent, plain when
    the caller says it has none (``lse_grad=False``)."""
    kern = cudnn.CudnnKernel(ops=cudnn.CudnnOps(), device=H100)
    args = KernelArgs(scale=0.125, is_causal=True)

    def loss(q, k, v):
        o, lse, _ = kern.attention(q, k, v, args, lse_grad=with_lse)
        return jnp.sum(o.astype(jnp.float32)) + (jnp.sum(lse) if with_lse else 0.0)

    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 64), jnp.bfloat16)
    calls = _cuda_custom_calls(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    assert [c[0] for c in calls].count("__cudnn$fmhaSoftmax") == 1
    assert [c[0] for c in calls].count("__cudnn$fmhaSoftmaxBackward") == 1
    fwd = next(sig for name, sig, _ in calls if name == "__cudnn$fmhaSoftmax")
    bwd = next(sig for name, sig, _ in calls if name == "__cudnn$fmhaSoftmaxBackward")
    assert "tensor<2x4x64xf32>" in fwd  # the float32 stats
    width = 64 + selection.AUGMENT_COLUMNS if with_lse else 64
    assert f"tensor<2x64x4x{width}xbf16>" in bwd and "tensor<2x4x64xf32>" in bwd


def test_window_lowers_to_cudnn_sliding_window():
    """A window (left, 0) lowered for CUDA: cuDNN's forward and backward custom calls carry
    ``sliding_window_length = left + 1`` with the causal mask (as jax.nn maps its
    ``local_window_size``); a window reaching right of the query is not sent there."""
    kern = cudnn.CudnnKernel(ops=cudnn.CudnnOps(), device=H100)
    args = KernelArgs(scale=0.125, window=(16, 0))

    def loss(q, k, v):
        o, lse, _ = kern.attention(q, k, v, args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    x = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    calls = _cuda_custom_calls(jax.grad(loss, (0, 1, 2)), x, x, x)
    assert len(calls) == 2, calls
    for _, _, line in calls:
        assert re.search(r'"sliding_window_length": 17\b', line), line
        assert '"mask_type": "CAUSAL"' in line, line
    with pytest.raises(ValueError, match="right of the query"):
        kern.forward(x, x, x, KernelArgs(scale=0.125, window=(16, 2)))


def _default_kernel_on_h100(monkeypatch):
    """The default kernel as it is chosen on a (described) H100: cuDNN."""
    auto = registry.AutoKernel(cudnn.CudnnKernel(ops=cudnn.CudnnOps(), device=H100))
    monkeypatch.setattr(registry, "select_implementation", lambda impl, **kw: "cudnn")
    monkeypatch.setattr(registry, "_auto_for", lambda device: auto)


@pytest.mark.parametrize("first", [64, jd.SlidingWindow(16)], ids=["segments", "window"])
@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_dilated_attention_lowers_to_cudnn(monkeypatch, mode, first):
    """jd.dilated_attention with the default kernel on a (described) H100 lowered for CUDA:
    one fused forward and one fused backward per branch (a sliding-window branch's with
    cuDNN's window, ``left + 1``)."""
    _default_kernel_on_h100(monkeypatch)
    x = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = jd.dilated_attention(q, k, v, segment_lengths=(first, 128),
                                 dilation_rates=(1, 2), mode=mode, is_causal=True)
        return jnp.sum(o.astype(jnp.float32))

    calls = _cuda_custom_calls(jax.grad(loss, (0, 1, 2)), x, x, x)
    names = [c[0] for c in calls]
    assert names.count("__cudnn$fmhaSoftmax") == 2
    assert names.count("__cudnn$fmhaSoftmaxBackward") == 2
    windowed = [c[0] for c in calls if '"sliding_window_length": 17,' in c[2]]
    want = [] if first == 64 else ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    assert sorted(windowed) == want


@pytest.mark.parametrize("causal", [False, True])
def test_torchscale_lowers_to_cudnn_per_branch(monkeypatch, causal):
    """``mode="torchscale"`` with the default kernel on a (described) H100: each branch
    on its zero-padded sequence (250 tokens: a short last segment, and 97 at rate 2
    shifting its outputs) is one fused cuDNN forward and one fused backward."""
    _default_kernel_on_h100(monkeypatch)
    x = jax.ShapeDtypeStruct((1, 250, 4, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = jd.dilated_attention(q, k, v, segment_lengths=(64, 97), dilation_rates=(1, 2),
                                 mode="torchscale", is_causal=causal)
        return jnp.sum(o.astype(jnp.float32))

    names = [c[0] for c in _cuda_custom_calls(jax.grad(loss, (0, 1, 2)), x, x, x)]
    assert names.count("__cudnn$fmhaSoftmax") == 2, names
    assert names.count("__cudnn$fmhaSoftmaxBackward") == 2, names


JAX_010_BWD = ["query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets",
               "kv_offsets", "page_table_k", "page_table_v", "activation", "fwd_output",
               "grad_output", "scale", "seed", "dropout_rate", "variadic_args",
               "mask_type", "layout", "sliding_window_length"]
JAX_012_BWD = (JAX_010_BWD[:13] + ["score_mod_args"] + JAX_010_BWD[13:] + ["score_mod"])


@pytest.mark.parametrize("names, unknown", [
    (JAX_010_BWD, None), (JAX_012_BWD, None),
    (JAX_012_BWD + ["block_table"], "block_table"),
    ([n for n in JAX_010_BWD if n != "fwd_output"], "misses ['fwd_output']"),
], ids=["jax_0.10", "jax_0.12", "unknown_param", "missing_array"])
def test_backward_signatures_the_backend_knows(monkeypatch, names, unknown):
    """The private backward's parameters of jax 0.10 and 0.12 are known; a parameter the
    backend cannot fill, or an array it needs that is gone, is reported by name (and
    cuDNN is then not used)."""
    from jax_dilated.backends import cudnn_probe
    monkeypatch.setattr(cudnn_probe, "backward_parameters", lambda: list(names))
    reason = cudnn_probe.primitive_signature_reason.__wrapped__()
    if unknown is None:
        assert reason is None, reason
    else:
        assert reason is not None and unknown in reason, reason


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
def test_rate_not_dividing_its_segment_lowers_for_cuda(monkeypatch, mode):
    """A branch whose rate does not divide its segment (120 at rate 7: its dilated
    segments end in slots that hold no position, masked keys) lowers for CUDA beside a
    dividing one; the dividing branch still runs on cuDNN, forward and backward."""
    _default_kernel_on_h100(monkeypatch)
    x = jax.ShapeDtypeStruct((1, 240, 4, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = jd.dilated_attention(q, k, v, segment_lengths=(48, 120), dilation_rates=(1, 7),
                                 mode=mode, is_causal=True)
        return jnp.sum(o.astype(jnp.float32))

    names = [c[0] for c in _cuda_custom_calls(jax.grad(loss, (0, 1, 2)), x, x, x)]
    assert names.count("__cudnn$fmhaSoftmax") >= 1, names
    assert names.count("__cudnn$fmhaSoftmaxBackward") >= 1, names


# ------------------------------------------- two calls of one signature in a program


def _seeds(calls):
    return [int(re.search(r'"seed": ?"?(\d+)', line).group(1)) for _, _, line in calls]


@pytest.mark.parametrize("distinct", [False, True])
def test_two_calls_of_one_signature_get_seeds_of_their_own(distinct):
    """The program of ``cudnn.repeated_calls_check`` (two forwards and two backwards of
    one signature, plain and windowed) lowered for CUDA: with ``distinct_seeds`` every
    cuDNN call carries a dropout seed of its own (its only difference from its twin),
    else JAX's 42 throughout; no dropout either way."""
    ops = cudnn.CudnnOps(distinct_seeds=distinct)
    q = jax.ShapeDtypeStruct((1, 64, 1, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    calls = _cuda_custom_calls(lambda *a: cudnn.two_of_a_kind(ops, *a), q, kv, kv, q)
    assert len(calls) == 8
    assert all(re.search(r'"dropout_rate": ?0', line) for _, _, line in calls)
    seeds = _seeds(calls)
    assert len(set(seeds)) == (8 if distinct else 1), seeds
    assert distinct or seeds[0] == 42


@pytest.mark.parametrize("outcome", ["runs", "runs_with_seeds", "fails"])
def test_repeated_calls_check_on_a_gpu(monkeypatch, outcome):
    """On a real GPU the kernel runs the check once before its first call (here its
    probe is stubbed): a program that runs leaves the seeds alone, one that runs only
    with distinct seeds turns them on, one that fails both ways keeps every call off
    cuDNN with the reason (implementation=None: the XLA kernel; "cudnn": ValueError)."""
    tried = []

    def probe(ops, device):
        tried.append(ops.distinct_seeds)
        if outcome == "runs" or (outcome == "runs_with_seeds" and ops.distinct_seeds):
            return None
        return "IndexError: absl::container_internal::raw_hash_map<>::at"

    monkeypatch.setattr(cudnn, "_run_probe", probe)
    monkeypatch.setattr(cudnn, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(cudnn, "DISTINCT_SEEDS", False)
    cudnn.repeated_calls_check.cache_clear()
    try:
        # a device the check is keyed by, with an H100's limits
        monkeypatch.setattr(cudnn.CudnnKernel, "info", property(lambda self: H100))
        kern = cudnn.CudnnKernel(ops=cudnn.CudnnOps(), device="gpu:0")
        x = jnp.zeros((1, 32, 2, 64), jnp.bfloat16)
        args = KernelArgs(scale=0.125)
        reason = kern.call_reason(x, x, args)
        kern.call_reason(x, x, args)  # once per device: the probe is not run again
        assert tried == {"runs": [False], "runs_with_seeds": [False, True],
                         "fails": [False, True]}[outcome]
        assert cudnn.DISTINCT_SEEDS == (outcome == "runs_with_seeds")
        if outcome == "fails":
            assert "two cuDNN attention calls of one signature" in reason
            assert "raw_hash_map" in reason
            auto = registry.AutoKernel(kern)
            assert auto.choose(x, x, args)[0] is auto.xla
            with pytest.raises(ValueError, match="one signature"):
                kern.forward(x, x, x, args)
        else:
            assert reason is None
    finally:
        cudnn.repeated_calls_check.cache_clear()


def test_repeated_calls_probe_runs_while_a_program_is_traced():
    """The probe runs its program eagerly also when the first cuDNN call is met while
    a program is traced (the kernel is asked then): here with the stand-in primitive on
    this CPU, inside ``jax.jit``."""
    seen = []

    def traced(x):
        seen.append(cudnn._run_probe(cudnn.ReferenceOps(), jax.devices()[0]))
        return x + 1

    jax.jit(traced)(1.0)
    assert seen == [None]
