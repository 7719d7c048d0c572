"""``jax_dilated.core.arrays``: ``take_static`` (``jnp.take`` at static indices whose
gradient is a gather and a select, not a scatter) and ``round_to``.

Checked against ``jnp.take`` itself (values and gradients, float64, random inputs
and cotangents): indices in any order, a column read by several indices, columns
read by none, a middle axis; masks pass through; out-of-range indices are refused.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dilated.core.arrays import round_to, take_static


@pytest.mark.parametrize("indices, axis", [
    ([5, 0, 3], 1),           # unordered, columns 1, 2, 4 unread
    ([2, 2, 6, 2, 0], 1),     # column 2 read three times
    ([1, 0], 2),              # an inner axis
    ([3], -1),                # one column, negative axis
])
def test_values_and_gradients_equal_jnp_take(indices, axis):
    rng = np.random.default_rng(len(indices) + axis)
    x = jnp.asarray(rng.standard_normal((3, 7, 4, 5)))
    ref = jnp.take(x, np.asarray(indices), axis=axis)
    got = take_static(x, indices, axis)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    ct = jnp.asarray(rng.standard_normal(ref.shape))
    g_ref = jax.grad(lambda x: jnp.sum(jnp.take(x, np.asarray(indices), axis=axis) * ct))(x)
    g_got = jax.grad(lambda x: jnp.sum(take_static(x, indices, axis) * ct))(x)
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_ref), rtol=1e-14, atol=0)
    assert float(jnp.max(jnp.abs(g_ref))) > 0


def test_gradient_holds_no_scatter():
    """The gradient's program has no scatter (``jnp.take``'s has one). (Read from the
    program JAX hands to XLA: a backend may expand a scatter into a loop.)"""
    x = jax.ShapeDtypeStruct((16, 32, 8), jnp.float32)
    cols = np.arange(4) * 8 + 1

    def ops(take):
        grad = jax.grad(lambda x: jnp.sum(jnp.sin(take(x))))
        text = jax.jit(grad).lower(x).as_text()
        return set(re.findall(r"stablehlo\.([\w-]+)", text))  # "stablehlo.scatter" -> op

    assert "scatter" in ops(lambda x: jnp.take(x, cols, axis=1))
    assert "scatter" not in ops(lambda x: take_static(x, cols, 1))


def test_masks_pass_through_and_bad_indices_are_refused():
    mask = jnp.asarray(np.random.default_rng(0).random((2, 6)) < 0.5)
    np.testing.assert_array_equal(np.asarray(take_static(mask, [4, 1], 1)),
                                  np.asarray(mask)[:, [4, 1]])
    with pytest.raises(ValueError, match=r"out of range for axis 1 of shape \(2, 6\)"):
        take_static(mask, [6], 1)
    with pytest.raises(ValueError, match="out of range"):
        take_static(mask, [-1], 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_rounds_inside_a_compiled_program(dtype):
    """round_to equals the round trip through ``dtype`` (NumPy's, via ml_dtypes) and
    stays a ``reduce_precision`` in the compiled program: a convert pair inside a
    fusion is what XLA drops on a GPU (seen on an H100: a bfloat16 KV cache read back
    unrounded, cuDNN's delta carried at bfloat16 precision)."""
    rng = np.random.default_rng(4)
    # magnitudes from float16's subnormals (below 6.1e-5) to beyond its range (65504)
    x = jnp.asarray(rng.standard_normal(513) * 10.0 ** rng.uniform(-9, 5, 513), jnp.float32)
    f = jax.jit(lambda x: round_to(x * 1.5, jnp.dtype(dtype)) - 1.0)
    with np.errstate(over="ignore"):  # beyond float16's range: inf, on both sides
        want = (np.asarray(x * 1.5).astype(jnp.dtype(dtype)).astype(np.float32)) - 1.0
    np.testing.assert_array_equal(np.asarray(f(x)), want)
    assert "reduce-precision" in f.lower(x).compile().as_text()
    assert round_to(x, jnp.float64) is x and round_to(x, jnp.float32) is x
