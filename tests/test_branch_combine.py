"""The batched one-device program (``ops/branch_combine.batched``: one kernel call per
branch, what a GPU runs head_groups with) on a described H100 whose cuDNN primitive is
the pure-JAX stand-in (``cudnn.ReferenceOps``; conftest's ``default_kernel``).

In head_groups mode each branch's heads are split out of q, k and v once
(``split_head_groups``), so that the backward concatenates the groups' gradients
instead of adding zero-padded full-size arrays. Checked: float64 outputs and gradients
equal the XLA kernel's (itself checked against the PyTorch references) at 1e-10, with
grouped-query heads that tile the groups or do not and a sliding-window branch; and the
backward's program holds no full-size addition.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dilated as jd
from _helpers import TOL, assert_close
from jax_dilated.ops import branch_combine


# implementation=None as a (described) H100 gets it: conftest's default_kernel fixture
ON_H100 = pytest.mark.parametrize("default_kernel", ["cudnn-reference"], indirect=True)


def _call(segs, rates, causal, implementation=None):
    def fn(q, k, v):
        return jd.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                    mode="head_groups", is_causal=causal,
                                    implementation=implementation)
    return fn


CASES = [  # heads, kv heads, segments, rates, causal
    pytest.param(6, 3, (16, 32, 64), (1, 2, 4), False, id="kv_groups_tile"),
    pytest.param(6, 2, (16, 32, 64), (1, 2, 4), True, id="kv_head_in_two_groups"),
    pytest.param(8, 2, (jd.SlidingWindow(4), 32, 64), (1, 2, 4), True, id="window_branch"),
]


@ON_H100
@pytest.mark.parametrize("h,hkv,segs,rates,causal", CASES)
def test_split_groups_equal_the_xla_kernel(default_kernel, monkeypatch, h, hkv, segs, rates,
                                           causal):
    used = []
    split = branch_combine.split_head_groups
    monkeypatch.setattr(branch_combine, "split_head_groups",
                        lambda *a: used.append(1) or split(*a))
    rng = np.random.default_rng(h * 10 + hkv)
    t, d = 64, 8
    q, g = (jnp.asarray(rng.standard_normal((2, t, h, d))) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, t, hkv, d))) for _ in range(2))
    results = []
    for impl in (None, "xla"):
        def out_and_grads(q, k, v, g, impl=impl):
            out, vjp = jax.vjp(_call(segs, rates, causal, impl), q, k, v)
            return (out, *vjp(g))
        # jitted: op by op, the two programs took most of this test's time
        results.append(jax.jit(out_and_grads)(q, k, v, g))
    assert used, "the batched program did not run"
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert_close(np.asarray(got), np.asarray(want), TOL["float64"], name)


@ON_H100
def test_backward_concatenates_the_groups_gradients(default_kernel):
    b, t, h, d = 1, 256, 8, 16
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    fn = _call((32, 64, 128, 256), (1, 2, 4, 8), False)

    def fwd_bwd(q, k, v, g):
        return jax.vjp(fn, q, k, v)[1](g)

    text = str(jax.make_jaxpr(fwd_bwd)(x, x, x, x))
    full = f"bf16[{b},{t},{h},{d}]"
    adds = [line for line in text.splitlines() if "add_any" in line and full in line]
    joins = [line for line in text.splitlines()
             if re.search(r"= concatenate\[", line) and full in line]
    assert not adds, adds[:2]
    assert len(joins) >= 3  # dq, dk and dv (and the output) joined from the groups
