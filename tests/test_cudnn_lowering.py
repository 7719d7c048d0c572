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
