"""The models' dense products through the BLAS (jax_dilated/backends/native/gemm.py):
``gemm.dot_general`` equals a float64 product to float32's precision, forward and in
every derivative, actually calls the BLAS for a linear layer's float32 product on
the CPU (bfloat16 ones by the route the CPU or the user chooses: XLA's dot with
float32 sums, MKL's bfloat16 GEMM or OpenBLAS widened), leaves every other product to
``jax.lax.dot_general`` unchanged, and the models use it on one device and XLA's dot
over a mesh."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_dilated as jd
from jax_dilated.backends.native import build, gemm

pytestmark = pytest.mark.skipif(gemm.unavailable_reason() is not None,
                                reason=f"no BLAS product: {gemm.unavailable_reason()}")

LINEAR = lambda nd: (((nd - 1,), (0,)), ((), ()))  # noqa: E731 (a Linear's contraction)
TOL = 1e-5  # float32 against float64, relative to the largest entry
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # one rounding of a bfloat16 result
# MKL's bfloat16 GEMM: None where the mkl wheel is installed (CI installs it)
NO_MKL = gemm._mkl()[2]
needs_mkl = pytest.mark.skipif(NO_MKL is not None, reason=f"no MKL: {NO_MKL}")


def _draw(*shapes, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def _calls_blas(fn, *args, bf16: bool | None = None) -> bool:
    """Whether ``fn``'s program calls a BLAS GEMM (``bf16``: MKL's bfloat16 one alone;
    False: OpenBLAS's alone; None: either)."""
    text = jax.jit(fn).lower(*args).as_text()
    float32, bfloat16 = (build.target(t) in text
                         for t in (build.TARGET_GEMM, build.TARGET_GEMM_BF16))
    return {None: float32 or bfloat16, True: bfloat16 and not float32,
            False: float32 and not bfloat16}[bf16]


@pytest.mark.parametrize("x_shape, n", [((3, 37, 50), 29), ((1, 7), 1), ((2, 300, 96), 130)])
def test_linear_products_run_on_the_blas_and_equal_float64(x_shape, n):
    x, w = _draw(x_shape, (x_shape[-1], n))
    fn = lambda x, w: gemm.dot_general(x, w, LINEAR(x.ndim))  # noqa: E731
    assert _calls_blas(fn, x, w)
    want = np.einsum("...k,kn->...n", x.astype(np.float64), w.astype(np.float64))
    assert _rel(jax.jit(fn)(x, w), want) < TOL
    assert _rel(fn(x, w), want) < TOL  # eagerly too


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_half_precision_products_run_on_the_blas_in_float32(dtype, preferred):
    """bfloat16 / float16 inputs are widened to float32 for the BLAS and the result
    rounded to their dtype (or kept in float32 when asked): the float64 product of the
    rounded inputs within one rounding of the result dtype, as XLA's own dot; and the
    gradients through XLA's products, in the inputs' dtype."""
    x, w = (jnp.asarray(a, dtype) for a in _draw((4, 33, 64), (64, 40), seed=7))
    fn = lambda x, w: gemm.dot_general(x, w, LINEAR(3),  # noqa: E731
                                       preferred_element_type=preferred)
    with gemm.using_bf16("openblas"):  # (bfloat16's choice on CPUs without its units)
        assert _calls_blas(fn, x, w, bf16=False)
        got = jax.jit(fn)(x, w)
    xla = jax.lax.dot_general(x, w, LINEAR(3), preferred_element_type=preferred)
    assert got.dtype == xla.dtype == (dtype if preferred is None else jnp.float32)
    want = np.einsum("btk,kn->btn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    rounding = float(jnp.finfo(got.dtype).eps)
    assert _rel(got, want) < max(TOL, rounding) and _rel(xla, want) < max(TOL, rounding)
    dx = jax.grad(lambda x: jnp.sum(fn(x, w).astype(jnp.float32)))(x)
    assert dx.dtype == dtype
    assert _rel(dx, np.broadcast_to(np.asarray(w, np.float64).sum(1), dx.shape)) < 1e-2


@needs_mkl
@pytest.mark.parametrize("preferred", [None, jnp.float32])
@pytest.mark.parametrize("x_shape, n", [((1300, 96), 130), ((2, 37, 64), 40), ((1, 7), 1)])
def test_bfloat16_products_on_mkl_equal_float64(x_shape, n, preferred):
    """bfloat16 inputs on MKL's bfloat16 GEMM (its own call, no widening; 1300 rows are
    three blocks of the threads' work): the float64 product of the inputs to float32's
    precision, as the widened OpenBLAS product, before the result's rounding; the
    gradient through XLA's products, in bfloat16."""
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in _draw(x_shape, (x_shape[-1], n), seed=8))
    nd = len(x_shape)
    fn = lambda x, w: gemm.dot_general(x, w, LINEAR(nd),  # noqa: E731
                                       preferred_element_type=preferred)
    want = np.einsum("...k,kn->...n", np.asarray(x, np.float64), np.asarray(w, np.float64))
    with gemm.using_bf16("mkl"):
        assert _calls_blas(fn, x, w, bf16=True)
        got = jax.jit(fn)(x, w)
        dx = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, w).astype(jnp.float32))))(x)
    with gemm.using_bf16("openblas"):
        widened = jax.jit(fn)(x, w)
    assert got.dtype == widened.dtype == (jnp.bfloat16 if preferred is None else jnp.float32)
    assert _rel(got, want) < (TOL if preferred is not None else BF16_EPS)
    assert _rel(got, widened) < (TOL if preferred is not None else BF16_EPS)
    assert dx.dtype == jnp.bfloat16
    assert _rel(dx, np.broadcast_to(np.asarray(w, np.float64).sum(1), dx.shape)) < 1e-2


@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_bfloat16_products_on_xla_with_float32_sums_equal_float64(preferred):
    """The "xla" route (CPUs with bfloat16 units that MKL does not use): XLA's dot asked
    for float32 sums, no BLAS call, the float64 product of the inputs to float32's
    precision before the result's rounding, as the widened OpenBLAS product; the
    gradient in bfloat16, equal to float64's to 1e-2."""
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in _draw((3, 300, 96), (96, 130), seed=9))
    fn = lambda x, w: gemm.dot_general(x, w, LINEAR(3),  # noqa: E731
                                       preferred_element_type=preferred)
    want = np.einsum("...k,kn->...n", np.asarray(x, np.float64), np.asarray(w, np.float64))
    with gemm.using_bf16("xla"):
        assert not _calls_blas(fn, x, w)
        got = jax.jit(fn)(x, w)
        dx = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, w).astype(jnp.float32))))(x)
    with gemm.using_bf16("openblas"):
        widened = jax.jit(fn)(x, w)
    assert got.dtype == widened.dtype == (jnp.bfloat16 if preferred is None else jnp.float32)
    assert _rel(got, want) < (TOL if preferred is not None else BF16_EPS)
    assert _rel(got, widened) < (TOL if preferred is not None else BF16_EPS)
    assert dx.dtype == jnp.bfloat16
    assert _rel(dx, np.broadcast_to(np.asarray(w, np.float64).sum(1), dx.shape)) < 1e-2


def test_the_xla_route_needs_no_blas(monkeypatch):
    """Where the BLAS cannot be called (no OpenBLAS, no native library), bfloat16
    products on the "xla" route still ask XLA's dot for float32 sums (the rate of the
    CPU's units), and other products are XLA's dot unchanged."""
    monkeypatch.setattr(gemm, "unavailable_reason", lambda: "no BLAS here")
    x, w = (jnp.asarray(a, jnp.bfloat16) for a in _draw((5, 64), (64, 24), seed=10))
    fn = lambda x, w: gemm.dot_general(x, w, LINEAR(2))  # noqa: E731
    with gemm.using_bf16("xla"):
        text = jax.jit(fn).lower(x, w).as_text()
    assert "bf16>, tensor<64x24xbf16>) -> tensor<5x24xf32>" in text  # float32 sums
    with gemm.using_bf16("mkl" if NO_MKL is None else "openblas"):
        text = jax.jit(fn).lower(x, w).as_text()
    assert "-> tensor<5x24xbf16>" in text and not _calls_blas(fn, x, w)


def test_bfloat16_route_follows_the_cpu_and_the_choice(monkeypatch):
    """The choice: XLA's dot with float32 sums on a CPU with bfloat16 units that is not
    Intel's (MKL does not multiply on them there), else MKL where it is installed,
    whatever the CPU (the report names its bfloat16 units, or their absence), else
    widened to float32; each forced by ``using_bf16`` or the variable; asking for MKL
    where it is missing is an error that says so."""
    for vendor, flags, route, units in (
            ("AuthenticAMD", set(), "mkl", "this CPU has no bfloat16 units"),
            ("AuthenticAMD", {"avx512_bf16"}, "xla", "AVX512-BF16"),
            ("GenuineIntel", {"avx512_bf16"}, "mkl", "AVX512-BF16"),
            ("GenuineIntel", {"amx_bf16", "avx512_bf16"}, "mkl", "AMX-BF16, AVX512-BF16")):
        monkeypatch.setattr(build, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(build, "cpu_vendor", lambda vendor=vendor: vendor)
        chosen, description = gemm.bf16_route()
        if route == "xla":
            assert (chosen, description) == ("xla", f"XLA's dot with float32 sums ({units})")
        elif NO_MKL is None:
            assert chosen == "mkl" and description.startswith("oneMKL")
            assert description.endswith(f"({units})")
            assert "bfloat16: oneMKL" in gemm.library_name()
        else:
            assert chosen == "openblas" and NO_MKL in gemm.library_name()
        for forced in ("openblas", "xla") + (("mkl",) if NO_MKL is None else ()):
            with gemm.using_bf16(forced):
                assert gemm.bf16_route()[0] == forced
    # (the variable is read once per process: read here at each call instead)
    monkeypatch.setattr(gemm, "_process_choice", lambda: os.environ.get(gemm.ENV, ""))
    monkeypatch.setenv(gemm.ENV, "openblas")
    assert gemm.bf16_route()[0] == "openblas" and "(chosen)" in gemm.library_name()
    monkeypatch.setattr(gemm, "_mkl", lambda: (None, None, "MKL is not installed"))
    monkeypatch.setenv(gemm.ENV, "mkl")
    with pytest.raises(RuntimeError, match="MKL were asked for, but MKL is not installed"):
        gemm.bf16_route()
    with pytest.raises(ValueError, match="library must be one of 'xla', 'mkl', 'openblas'"):
        with gemm.using_bf16("onednn"):
            pass


def test_derivatives_equal_float64_in_both_modes_and_under_vmap():
    """Reverse mode (both arguments, one of them), forward mode, a second derivative
    and vmap against float64 formulas: the BLAS runs the primal, XLA the tangents."""
    x, w, g = _draw((4, 23, 40), (40, 17), (4, 23, 17), seed=1)
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, g))
    loss = lambda x, w: jnp.sum(gemm.dot_general(x, w, LINEAR(3)) * g)  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert _rel(dx, np.einsum("btn,kn->btk", g64, w64)) < TOL
    assert _rel(dw, np.einsum("btk,btn->kn", x64, g64)) < TOL
    assert _rel(jax.grad(loss, argnums=1)(x, w), np.einsum("btk,btn->kn", x64, g64)) < TOL
    tx, tw = _draw((4, 23, 40), (40, 17), seed=2)
    _, tangent = jax.jvp(lambda x, w: gemm.dot_general(x, w, LINEAR(3)), (x, w), (tx, tw))
    want = (np.einsum("btk,kn->btn", tx.astype(np.float64), w64)
            + np.einsum("btk,kn->btn", x64, tw.astype(np.float64)))
    assert _rel(tangent, want) < TOL
    # d/dw of sum((x w)^2) = 2 x^T (x w); its derivative along tw: 2 x^T (x tw)
    hvp = jax.jvp(jax.grad(lambda w: jnp.sum(gemm.dot_general(x, w, LINEAR(3)) ** 2)),
                  (w,), (tw,))[1]
    assert _rel(hvp, 2 * np.einsum("btk,btn->kn", x64,
                                   np.einsum("btk,kn->btn", x64, tw.astype(np.float64)))) < TOL
    batched = jax.vmap(lambda x: gemm.dot_general(x, w, LINEAR(2)))(x)
    assert _rel(batched, np.einsum("btk,kn->btn", x64, w64)) < TOL


def test_bad_input_raises_as_jax_does():
    """Shapes that do not multiply raise jax.lax.dot_general's own error at trace time
    (not the FFI call's at run time); an unknown JAX_DILATED_DENSE names the variable."""
    x, w = _draw((5, 6), (7, 3))
    with pytest.raises(TypeError) as ours:
        jax.jit(lambda x, w: gemm.dot_general(x, w, LINEAR(2))).lower(x, w)
    with pytest.raises(TypeError) as jax_own:
        jax.lax.dot_general(x, w, LINEAR(2))
    assert str(ours.value) == str(jax_own.value)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gemm.ENV, "off")
        with pytest.raises(ValueError, match="JAX_DILATED_DENSE must be 'xla'.*'off'"):
            gemm._blas.__wrapped__()


@pytest.mark.parametrize("case", ["float64", "mixed_dtypes", "batch_axes",
                                  "other_contraction", "empty_rows", "empty_sum"])
def test_other_products_are_xla_dot_general_unchanged(case):
    """Everything but a linear layer's non-empty float32, bfloat16 or float16 product
    is ``jax.lax.dot_general``'s own (no BLAS call; the same result bit for bit)."""
    x, w = _draw((5, 6), (6, 3), seed=3)
    dn, kw = LINEAR(2), {}
    if case == "float64":
        x, w = x.astype(np.float64), w.astype(np.float64)
    elif case == "mixed_dtypes":
        w = jnp.asarray(w, jnp.bfloat16)
    elif case == "batch_axes":
        (x, w), dn = _draw((2, 5, 6), (2, 6, 3), seed=3), (((2,), (1,)), ((0,), (0,)))
    elif case == "other_contraction":
        (x, w), dn = _draw((6, 5), (6, 3), seed=3), (((0,), (0,)), ((), ()))
    elif case == "empty_rows":
        x = np.zeros((0, 6), np.float32)
    else:
        x, w = np.zeros((5, 0), np.float32), np.zeros((0, 3), np.float32)
    fn = lambda x, w: gemm.dot_general(x, w, dn, **kw)  # noqa: E731
    assert not _calls_blas(fn, x, w)
    got = jax.jit(fn)(x, w)
    want = jax.jit(lambda x, w: jax.lax.dot_general(x, w, dn, **kw))(x, w)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


def test_models_use_it_on_one_device_and_xla_over_a_mesh():
    """The encoder's and the slide encoder's Linear layers take the BLAS product
    without a mesh (their program calls it) and XLA's over one; the encoder's output
    is XLA's to float32 precision."""
    cfg = jd.models.LongNetEncoderConfig(embed_dim=32, num_layers=1, num_heads=2, ffn_dim=48,
                                         segment_lengths=(8, 16), dilation_rates=(1, 2))
    enc = jd.models.LongNetEncoder(cfg, rngs=nnx.Rngs(0))
    linears = [m for _, m in nnx.iter_modules(enc) if isinstance(m, nnx.Linear)]
    assert len(linears) == 6 and all(m.dot_general is gemm.dot_general for m in linears)
    (x,) = _draw((2, 21, 32), seed=4)
    def program(module):
        graph, state = nnx.split(module)
        return (lambda state, x: nnx.merge(graph, state)(x)), state

    run, state = program(enc)
    assert _calls_blas(run, state, x)
    got = jax.jit(run)(state, x)
    for m in linears:
        m.dot_general = jax.lax.dot_general
    run, state = program(enc)
    assert not _calls_blas(run, state, x)
    assert _rel(got, jax.jit(run)(state, x)) < TOL

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("seq",))
    slide = jd.models.SlideEncoder(
        jd.models.SlideEncoderConfig(in_features=12, embed_dim=32, num_layers=1, num_heads=2,
                                     ffn_dim=48, max_wsi_size=4096),
        rngs=nnx.Rngs(0), mesh=mesh, seq_axis="seq")
    assert all(m.dot_general is jax.lax.dot_general
               for _, m in nnx.iter_modules(slide) if isinstance(m, nnx.Linear))
    one = jd.models.SlideEncoder(slide.config, rngs=nnx.Rngs(0))
    assert one.patch_embed.proj.dot_general is gemm.dot_general


def test_the_environment_variable_turns_it_off():
    """``JAX_DILATED_DENSE=xla``: no BLAS, the reason says so, the product is XLA's."""
    code = ("import jax, numpy as np; from jax_dilated.backends.native import build, gemm\n"
            "x = np.ones((3, 4), np.float32)\n"
            "f = lambda x: gemm.dot_general(x, x.T, (((1,), (0,)), ((), ())))\n"
            "print(gemm.unavailable_reason(), build.target(build.TARGET_GEMM) in "
            "jax.jit(f).lower(x).as_text())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, JAX_DILATED_DENSE="xla"), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "JAX_DILATED_DENSE=xla False"


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_attention_layers_project_on_the_blas_and_equal_float64(api, monkeypatch):
    """The multi-head layers' q/k/v and output projections (``[B, T, E] . [E, H D]``
    and ``[B, T, H D] . [H D, E]``) run on the BLAS without a mesh; the output and the
    gradients of the input and every parameter equal the layer's own einsums in float64
    to float32 precision.
    LongNetLM's feed-forward and head take it too."""
    (x,) = _draw((2, 24, 32), seed=5)
    options = dict(segment_lengths=(8, 24), dilation_rates=(1, 2), layer_norm=True)
    if api == "nnx":
        layer = jd.nnx.MultiheadDilatedAttention(32, 4, **options, rngs=nnx.Rngs(0))
        graph, state = nnx.split(layer)
        run = lambda state, x: nnx.merge(graph, state)(x)  # noqa: E731
    else:
        layer = jd.linen.MultiheadDilatedAttention(32, 4, **options)
        state = layer.init(jax.random.key(0), x)
        run = layer.apply
    wide = lambda a: a.astype(np.float64) if a.dtype == np.float32 else a  # noqa: E731
    assert _calls_blas(run, state, x)
    (g,) = _draw((2, 24, 32), seed=8)
    loss = lambda state, x: jnp.sum(run(state, x) * g)  # noqa: E731
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    # the reference: the layer's own einsums (no dot_general), in float64
    monkeypatch.setattr(gemm, "for_mesh", lambda mesh: None)
    state64, x64 = jax.tree.map(wide, state), x.astype(np.float64)
    assert not _calls_blas(run, state64, x64)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state64, x64)
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    scale = max(np.abs(np.asarray(w)).max() for _, w in leaves)
    for a, w in leaves:
        if np.abs(np.asarray(w)).max() > 1e-6 * scale:
            assert _rel(a, w) < TOL
        else:  # a gradient that is zero (the key bias: softmax ignores a shift of k)
            assert np.abs(np.asarray(a)).max() < TOL * scale
    monkeypatch.undo()

    lm = jd.models.LongNetLM(jd.models.LongNetConfig(
        vocab_size=50, embed_dim=32, num_heads=4, num_layers=1, segment_lengths=(8,),
        dilation_rates=(1,), max_len=16, tie_embeddings=False), rngs=nnx.Rngs(0))
    assert lm.blocks[0].ffn.fc1.dot_general is gemm.dot_general
    assert lm.head.dot_general is gemm.dot_general


def test_a_product_traced_under_another_build_calls_that_build():
    """Under ``build.using(...)`` (tests and benchmarks switch builds) the product calls
    the GEMM of the build in use, which is set for it too."""
    x, w = _draw((9, 20), (20, 7), seed=6)
    want = x.astype(np.float64) @ w.astype(np.float64)
    fn = lambda x, w: gemm.dot_general(x, w, LINEAR(2))  # noqa: E731
    with build.using(isa=build.EMULATED):
        if build.library() is None:  # aarch64: the NEON build is the only one there
            pytest.skip(f"no {build.EMULATED} build here: {build.load()}")
        assert build.target(build.TARGET_GEMM) in jax.jit(fn).lower(x, w).as_text()
        assert _rel(jax.jit(fn)(x, w), want) < TOL


# ------------------------------------------------ fc1, GELU and LayerNorm in one call

def _gelu_norm_float64(x, w, bias, scale, shift, eps):
    """LayerNorm(gelu(x w + bias)) * scale + shift in float64: the exact GELU by
    math.erf, the biased variance."""
    erf = np.vectorize(math.erf)
    h = np.einsum("...k,kn->...n", x.astype(np.float64), w.astype(np.float64)) + bias
    g = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
    c = g - g.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * scale + shift


def _ffn_parts(x_shape, n, seed):
    """x [..., K], w [K, N] scaled so that fc1's outputs span the GELU's whole range
    (|h| up to ~12: the erf's clamp at 4 / sqrt 2 and both tails), bias, scale, shift."""
    x, w, bias, scale, shift = _draw(x_shape, (x_shape[-1], n), (n,), (n,), (n,), seed=seed)
    w *= np.float32(3.0 / np.sqrt(x_shape[-1]))
    return x, w, bias, np.float32(1.0) + np.float32(0.1) * scale, np.float32(0.1) * shift


def _fused_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(build.target(build.TARGET_GEMM_GELU_NORM))


@pytest.mark.parametrize("x_shape, n", [((1300, 40), 37), ((2, 650, 24), 64), ((1, 7), 9)])
def test_gelu_norm_product_equals_float64(x_shape, n):
    """gemm.linear_gelu_norm's one call against float64: 1300 rows (two of the call's
    1024-row blocks, the second partial), leading axes, a width that is no multiple of
    the vector lanes, a single row."""
    from jax_dilated.models.encoder import _fc1_gelu_norm
    parts = _ffn_parts(x_shape, n, seed=7)
    assert gemm.gelu_norm_servable(*parts)
    fn = lambda *p: gemm.linear_gelu_norm(*p, 1e-5, _fc1_gelu_norm)  # noqa: E731
    assert _fused_calls(fn, *parts) == 1
    got = jax.jit(fn)(*parts)
    assert got.shape == (*x_shape[:-1], n) and got.dtype == jnp.float32
    assert _rel(got, _gelu_norm_float64(*parts, 1e-5)) < TOL


def test_gelu_norm_product_derivatives_equal_the_layers():
    """Its derivatives (reverse mode with respect to all five arrays and to x alone,
    forward mode) against those of nnx's own Linear, GELU and LayerNorm composed by XLA,
    and the primal against them too: the XLA composition the call's derivatives take
    and its wiring to the call's arguments."""
    from jax_dilated.models.encoder import _exact_gelu, _fc1_gelu_norm
    x, w, bias, scale, shift = _ffn_parts((3, 45, 24), 40, seed=8)
    (g,) = _draw((3, 45, 40), seed=9)
    fc1 = nnx.Linear(24, 40, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))
    norm = nnx.LayerNorm(40, epsilon=1e-5, use_fast_variance=False, rngs=nnx.Rngs(0))
    fc1.kernel[...], fc1.bias[...], norm.scale[...], norm.bias[...] = w, bias, scale, shift
    graph, state = nnx.split((fc1, norm))

    def layers(x, state):
        f, n = nnx.merge(graph, state)
        return n(_exact_gelu(f(x)))

    def fused(x, state):
        f, n = nnx.merge(graph, state)
        return gemm.linear_gelu_norm(x, f.kernel[...], f.bias[...], n.scale[...], n.bias[...],
                                     1e-5, _fc1_gelu_norm)

    assert _fused_calls(fused, x, state) == 1
    assert _rel(jax.jit(fused)(x, state), jax.jit(layers)(x, state)) < TOL
    for argnums in ((0, 1), 0):
        want = jax.grad(lambda *a: jnp.sum(layers(*a) * g), argnums=argnums)(x, state)
        got = jax.jit(jax.grad(lambda *a: jnp.sum(fused(*a) * g), argnums=argnums))(x, state)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert _rel(a, b) < 1e-4
    (tx,) = _draw(x.shape, seed=10)
    want = jax.jvp(lambda x: layers(x, state), (x,), (tx,))[1]
    assert _rel(jax.jvp(lambda x: fused(x, state), (x,), (tx,))[1], want) < 1e-4


def test_the_encoder_fuses_its_feed_forward_for_float32_inference_on_one_cpu():
    """LongNetEncoder's fc1, GELU and ffn_layernorm run as the one call in float32
    inference on one device (one call per layer), equal to the layers' own path; not
    with the activation dropout acting, nor in bfloat16, nor over a mesh."""
    base = dict(embed_dim=32, num_layers=2, num_heads=2, ffn_dim=48,
                segment_lengths=(8, 16), dilation_rates=(1, 2))
    (x,) = _draw((2, 21, 32), seed=11)

    def calls(cfg, x, **kw):
        enc = jd.models.LongNetEncoder(cfg, rngs=nnx.Rngs(0), **kw)
        graph, state = nnx.split(enc)
        run = lambda state, x: nnx.merge(graph, state)(x, deterministic=False)  # noqa: E731
        return _fused_calls(run, state, x), enc

    cfg = jd.models.LongNetEncoderConfig(**base)
    n, enc = calls(cfg, x)
    assert n == 2
    got = enc(x)
    for layer in enc.layers:  # the same layers through their unfused path
        layer.ffn.fc1.dot_general = jax.lax.dot_general
    assert _rel(got, enc(x)) < TOL
    dropped = jd.models.LongNetEncoderConfig(**base, activation_dropout_rate=0.1)
    assert calls(dropped, x)[0] == 0
    assert calls(jd.models.LongNetEncoderConfig(**base, dtype=jnp.bfloat16),
                 x.astype(jnp.bfloat16))[0] == 0
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("seq",))
    assert calls(cfg, x, mesh=mesh, seq_axis="seq")[0] == 0
