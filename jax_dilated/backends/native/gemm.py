"""Dense products on the CPU through a tuned BLAS GEMM, for the layers' and models' linear
products.

OpenBLAS's GEMM computes the dense layers' products (tokens x 768 x 3072) faster than
XLA's CPU dot, and more accurately (docs/benchmarks.md, "CPU: the dense
layers' products"). :func:`dot_general` is a drop-in for :func:`jax.lax.dot_general`
(nnx.Linear's ``dot_general=``) that sends the products a linear layer makes
(``x [..., K] . w [K, N]``) to OpenBLAS's ``cblas_sgemm`` by an XLA FFI call
(``gemm_cpu.cc``, in the native kernel's library), and every other product, or any
product on another platform than the CPU, to ``jax.lax.dot_general`` unchanged:

    y [..., N] = x [..., K] . w [K, N]      (float32 products and sums)

bfloat16 and float16 inputs are widened to float32 (exactly) and the result rounded to
their dtype, or left in float32 for ``preferred_element_type=float32``: what XLA's own
half-precision dot computes on a CPU, and faster than it on CPUs measured so far,
which have no bfloat16 GEMM in XLA or in this OpenBLAS (docs/benchmarks.md).

Its derivatives are those of the same product by XLA (a ``custom_jvp`` whose tangents
are ``jax.lax.dot_general``, which JAX transposes for reverse mode), so forward- and
reverse-mode differentiation, ``vmap`` and ``jit`` work as for ``jax.lax.dot_general``;
only the primal product runs on the BLAS (inference, and the forward of training).

The BLAS is OpenBLAS from the ``scipy-openblas32`` wheel (a dependency on Linux, the
OpenBLAS NumPy and SciPy ship). Where it or the native library is missing, or
``JAX_DILATED_DENSE=xla`` is set (read once, on the first product), every product is
XLA's and :func:`unavailable_reason` says why. The product runs on one device's
buffers, so a program sharded over a mesh by XLA (GSPMD) keeps XLA's dot: the layers
and models take :func:`for_mesh`'s choice, the BLAS only when they run without a mesh
(inside ``shard_map`` each device's product is local and may use it).
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.native import build

__all__ = ["dot_general", "for_mesh", "unavailable_reason", "library_name", "ENV"]

# "xla" sends every product to XLA's dot
ENV = "JAX_DILATED_DENSE"
_INT32_MAX = 2**31 - 1
# the input dtypes the BLAS multiplies (half precision widened to float32: exact)
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.lru_cache(maxsize=None)
def _blas() -> tuple[str | None, int | None, str | None]:
    """``(description, address of its cblas_sgemm, None)`` where the native library can
    call OpenBLAS's GEMM, else ``(None, None, why not)`` (once per process)."""
    choice = os.environ.get(ENV, "")
    if choice not in ("", "xla"):
        raise ValueError(f"{ENV} must be 'xla' (XLA's dot for every product) or unset, got "
                         f"{choice!r}.")
    if choice == "xla":
        return None, None, f"{ENV}=xla"
    # OpenBLAS's idle threads spin for about 2**28 cycles after each product, competing
    # for the cores with the XLA ops and the attention kernel that run next; 2**4 lets
    # them sleep at once. Read when the library loads.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        import scipy_openblas32  # loads the library into the process
    except ImportError:
        return None, None, "scipy-openblas32 is not installed (pip install scipy-openblas32)"
    why = build.load()
    if why is not None:
        return None, None, f"the native library is not available ({why})"
    lib_dir = scipy_openblas32.get_lib_dir()
    blas = ctypes.CDLL(os.path.join(lib_dir, scipy_openblas32.get_library(fullname=True)))
    sgemm = getattr(blas, "scipy_cblas_sgemm", None) or getattr(blas, "cblas_sgemm", None)
    if sgemm is None:
        return None, None, f"no cblas_sgemm in {lib_dir}"
    address = ctypes.cast(sgemm, ctypes.c_void_p).value
    return f"OpenBLAS {scipy_openblas32.__version__} cblas_sgemm", address, None


# the libraries (by path) whose GEMM is set
_pointed: set = set()


def _target(library: build.Library) -> str:
    """The GEMM call's target in ``library`` (the build in use, which
    :func:`jax_dilated.backends.native.build.using` may switch), its GEMM set first."""
    if library.path not in _pointed:
        library.handle.JaxDilatedSetSgemm.argtypes = [ctypes.c_void_p]
        library.handle.JaxDilatedSetSgemm(_blas()[1])
        _pointed.add(library.path)
    return library.targets[build.TARGET_GEMM]


def unavailable_reason() -> str | None:
    """None where :func:`dot_general` sends a linear layer's products to the BLAS, else
    why not."""
    return _blas()[2]


def library_name() -> str | None:
    """The GEMM the products call (for ``jd.backend_report()``), or None."""
    return _blas()[0]


def _servable(lhs, rhs, dimension_numbers, preferred_element_type, out_sharding):
    """The dtype of the BLAS's result where the product is a linear layer's that it
    computes (``lhs [..., K]`` contracted on its last axis with ``rhs [K, N]``'s first,
    no batch axes, both float32 or both bfloat16 / float16, every dimension non-empty
    and within 32-bit BLAS integers), else None."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lhs.ndim < 1 or rhs.ndim != 2 or lb or rb or out_sharding is not None:
        return None
    if tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,):
        return None
    if lhs.dtype != rhs.dtype or lhs.dtype not in _DTYPES:
        return None
    out = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    if out not in (lhs.dtype, jnp.float32):
        return None
    m = int(np.prod(lhs.shape[:-1], dtype=np.int64))
    k, n = rhs.shape
    if lhs.shape[-1] != k:  # (jax.lax.dot_general says so, naming both shapes)
        return None
    if min(m, k, n) == 0 or max(m, k, n) > _INT32_MAX:
        return None
    # (where JAX runs on an accelerator, no native build for a product it will not run)
    if jax.default_backend() != "cpu" or unavailable_reason() is not None:
        return None
    return out


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None):
    """:func:`jax.lax.dot_general`, with a linear layer's float32, bfloat16 or float16
    product on the CPU computed by the BLAS (module docstring). Same arguments, result
    and errors."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out = _servable(lhs, rhs, dimension_numbers, preferred_element_type, out_sharding)
    if out is None:
        kw = {} if out_sharding is None else {"out_sharding": out_sharding}
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kw)
    lead = lhs.shape[:-1]
    a = lhs.reshape(-1, lhs.shape[-1]).astype(jnp.float32)
    y = _matmul(a, rhs.astype(jnp.float32))
    return y.reshape(*lead, rhs.shape[1]).astype(out)


@jax.custom_jvp
def _matmul(a, b):
    """``a [M, K] . b [K, N]`` by the BLAS on the CPU, by XLA elsewhere."""
    return jax.lax.platform_dependent(a, b, cpu=_blas_matmul, default=jnp.matmul)


def _matmul_jvp(primals, tangents):
    a, b = primals
    # XLA's products, which JAX can transpose (the FFI call it could not); a zero
    # tangent (an input not differentiated) adds no product
    terms = [jnp.matmul(t, b) for t in tangents[:1] if not _zero(t)]
    terms += [jnp.matmul(a, t) for t in tangents[1:] if not _zero(t)]
    y = _matmul(a, b)
    return y, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(y)


def _zero(tangent) -> bool:
    return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


_matmul.defjvp(_matmul_jvp, symbolic_zeros=True)


def for_mesh(mesh: jax.sharding.Mesh | None):
    """The ``dot_general`` of a layer's products: :func:`dot_general` on one device,
    ``jax.lax.dot_general`` over a mesh (which XLA partitions over the mesh; the FFI
    call would be gathered whole onto each device)."""
    return dot_general if mesh is None else jax.lax.dot_general


def _blas_matmul(a, b):
    call = jax.ffi.ffi_call(_target(build.library()),
                            jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(a, b)
