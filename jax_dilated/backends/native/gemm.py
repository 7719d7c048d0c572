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

bfloat16 products are computed as bfloat16 products summed in float32, by whichever of
three routes is fastest on the CPU (:func:`bf16_route`; docs/benchmarks.md, "CPU: the
dense layers' products"):

    y [..., N] = x [..., K] . w [K, N]      (bfloat16 products, float32 sums)

- ``"xla"``, on a CPU with bfloat16 units (AVX512-BF16's ``vdpbf16ps``, AMX tiles) that
  is not Intel's: XLA's own dot asked for float32 sums (``preferred_element_type``),
  which multiplies on the units (2.7-3.7x MKL on a Zen 5, where MKL's bfloat16 GEMM
  runs without them; jax 0.10's dot with bfloat16 results does not use them either);
- ``"mkl"``, elsewhere where oneMKL is installed (``pip install jax-dilated[mkl]``,
  x86-64 Linux): MKL's ``cblas_gemm_bf16bf16f32``, on the units where MKL uses them
  (Intel's), the rows cut into blocks among XLA's threads; faster than the widened
  product even without units (one pass less over the inputs: 1.31x on a Zen 3);
- ``"openblas"``, else: the inputs widened to float32 (exactly) for OpenBLAS, as
  float16 inputs always are.

All compute the products of the rounded inputs exactly (a bfloat16 product fits a
float32) and sum them in float32, so they differ only in the order of the sums; the
result is rounded to the inputs' dtype, or left in float32 for
``preferred_element_type=float32``: what XLA's own half-precision dot computes on a
CPU. ``JAX_DILATED_DENSE=openblas`` or ``=mkl`` forces that route for bfloat16 (a
missing MKL is then an error); :func:`using_bf16` chooses for the programs traced
inside it.

Its derivatives are those of the same product by XLA (a ``custom_jvp`` whose tangents
are ``jax.lax.dot_general``, which JAX transposes for reverse mode), so forward- and
reverse-mode differentiation, ``vmap`` and ``jit`` work as for ``jax.lax.dot_general``;
only the primal product runs on the BLAS (inference, and the forward of training).

The BLAS is OpenBLAS from the ``scipy-openblas32`` wheel (a dependency on Linux, the
OpenBLAS NumPy and SciPy ship); MKL is the ``mkl`` wheel's ``libmkl_rt`` (an optional
extra), run sequentially on each block. Where OpenBLAS or the native library is
missing, or ``JAX_DILATED_DENSE=xla`` is set (read once, on the first product), every
product is XLA's (bfloat16's with float32 sums where its route is ``"xla"``) and
:func:`unavailable_reason` says why. The product runs on one device's
buffers, so a program sharded over a mesh by XLA (GSPMD) keeps XLA's dot: the layers
and models take :func:`for_mesh`'s choice, the BLAS only when they run without a mesh
(inside ``shard_map`` each device's product is local and may use it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_dilated.backends.native import build

__all__ = ["dot_general", "for_mesh", "unavailable_reason", "library_name", "bf16_route",
           "using_bf16", "ENV", "gelu_norm_servable", "linear_gelu_norm"]

# "xla" sends every product to XLA's dot; "mkl" / "openblas" choose bfloat16's GEMM
ENV = "JAX_DILATED_DENSE"
_CHOICES = ("", "xla", "mkl", "openblas")
# the CPU flags of bfloat16 units
_BF16_UNITS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}
# the routes of bfloat16 products (module docstring)
_BF16_ROUTES = ("xla", "mkl", "openblas")
# mkl_service.h's codes
_MKL_THREADING_SEQUENTIAL = 1
_MKL_INTERFACE_LP64 = 0
_INT32_MAX = 2**31 - 1
# the input dtypes the BLAS multiplies (half precision widened to float32: exact)
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.lru_cache(maxsize=None)
def _blas() -> tuple[str | None, int | None, str | None]:
    """``(description, address of its cblas_sgemm, None)`` where the native library can
    call OpenBLAS's GEMM, else ``(None, None, why not)`` (once per process)."""
    choice = _choice()
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
    core = getattr(blas, "scipy_openblas_get_corename", None)
    kernels = ""
    if core is not None:
        core.restype = ctypes.c_char_p
        kernels = f" ({core().decode(errors='replace')} kernels)"
    return f"OpenBLAS {scipy_openblas32.__version__} cblas_sgemm{kernels}", address, None


def _choice() -> str:
    """``$JAX_DILATED_DENSE``, checked."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{ENV} must be 'xla' (XLA's dot for every product), 'mkl' or "
                         f"'openblas' (bfloat16's products on that library) or unset, got "
                         f"{choice!r}.")
    return choice


# the bfloat16 GEMMs `using_bf16` selects, innermost last
_bf16_override: list[str] = []


@contextlib.contextmanager
def using_bf16(library: str):
    """Programs traced inside send bfloat16 products to ``library``: ``"xla"`` (XLA's
    dot with float32 sums), ``"mkl"`` (MKL's bfloat16 GEMM; an error where MKL is not
    installed) or ``"openblas"`` (widened to float32), as ``JAX_DILATED_DENSE`` does
    for a whole process (benchmarks of one against another, tests of each); JAX's
    caches are cleared on entry and exit
    (:func:`jax_dilated.backends.native.build.traced_with`)."""
    if library not in _BF16_ROUTES:
        raise ValueError(f"library must be one of {', '.join(map(repr, _BF16_ROUTES))}, "
                         f"got {library!r}")
    with build.traced_with(_bf16_override, library):
        yield


def bf16_route() -> tuple[str, str]:
    """``(route, description)`` of the linear layers' bfloat16 products where the BLAS
    serves them (:func:`unavailable_reason` is None): ``"xla"``, ``"mkl"`` or
    ``"openblas"`` (module docstring), as chosen (:func:`using_bf16`,
    ``JAX_DILATED_DENSE``) or by the CPU."""
    choice = _bf16_override[-1] if _bf16_override else _process_choice()
    flags = build.cpu_flags()
    units = ", ".join(name for flag, name in _BF16_UNITS.items() if flag in flags)
    if choice == "openblas":
        return "openblas", "widened to float32 for OpenBLAS (chosen)"
    if choice == "xla" or (choice == "" and units and build.cpu_vendor() != "GenuineIntel"):
        return "xla", (f"XLA's dot with float32 sums ({units or 'no bfloat16 units'}"
                       f"{'; chosen' if choice else ''})")
    description, _, why = _mkl()
    if why is None:
        return "mkl", f"{description} ({units or 'this CPU has no bfloat16 units'})"
    if choice == "mkl":
        raise RuntimeError(f"bfloat16 products on MKL were asked for, but {why}.")
    return "openblas", f"widened to float32 for OpenBLAS ({why})"


@functools.lru_cache(maxsize=None)
def _process_choice() -> str:
    """``$JAX_DILATED_DENSE`` as first read in this process."""
    return _choice()


@functools.lru_cache(maxsize=None)
def _mkl() -> tuple[str | None, int | None, str | None]:
    """``(description, address of MKL's cblas_gemm_bf16bf16f32, None)``, else
    ``(None, None, why not)`` (loaded once per process)."""
    path = _mkl_path()
    if path is None:
        return None, None, "oneMKL's libmkl_rt is not installed (pip install mkl)"
    mkl = ctypes.CDLL(str(path))
    # before any other MKL call: 32-bit integers, and no threads of MKL's own (the
    # native call cuts the rows among XLA's); a layer another library set first stays
    mkl.MKL_Set_Interface_Layer(_MKL_INTERFACE_LP64)
    layer = mkl.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
    version = ctypes.create_string_buffer(200)
    mkl.mkl_get_version_string(version, len(version))
    number = version.value.decode(errors="replace").split("Version ")[-1].split("-")[0]
    threaded = "" if layer == _MKL_THREADING_SEQUENTIAL else ", MKL threaded"
    address = ctypes.cast(mkl.cblas_gemm_bf16bf16f32, ctypes.c_void_p).value
    return f"oneMKL {number.strip()} cblas_gemm_bf16bf16f32{threaded}", address, None


def _mkl_path() -> pathlib.Path | None:
    """The mkl wheel's libmkl_rt (it installs into the environment's lib directory),
    else one the system's loader finds, else None."""
    for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"):
        path = pathlib.Path(sys.prefix) / "lib" / name
        if path.exists():
            return path
    found = ctypes.util.find_library("mkl_rt")
    return pathlib.Path(found) if found else None


# (library path, bfloat16 or not) whose GEMM is set
_pointed: set = set()


def _target(library: build.Library, bf16: bool, fused: bool = False) -> str:
    """The target of the GEMM call (``bf16``: MKL's bfloat16 one; ``fused``: the float32
    product with the GELU and LayerNorm epilogue) in ``library`` (the build in use,
    which :func:`jax_dilated.backends.native.build.using` may switch), its GEMM set
    first."""
    if (library.path, bf16) not in _pointed:
        handle = library.handle
        setter = handle.JaxDilatedSetGemmBf16 if bf16 else handle.JaxDilatedSetSgemm
        setter.argtypes = [ctypes.c_void_p]
        setter(_mkl()[1] if bf16 else _blas()[1])
        _pointed.add((library.path, bf16))
    if fused:
        return library.targets[build.TARGET_GEMM_GELU_NORM]
    return library.targets[build.TARGET_GEMM_BF16 if bf16 else build.TARGET_GEMM]


def unavailable_reason() -> str | None:
    """None where :func:`dot_general` sends a linear layer's products to the BLAS, else
    why not."""
    return _blas()[2]


def library_name() -> str | None:
    """The GEMMs the products call (for ``jd.backend_report()``), or None."""
    if _blas()[0] is None:
        return None
    return f"{_blas()[0]}; bfloat16: {bf16_route()[1]}"


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
    if jax.default_backend() != "cpu":
        return None
    if unavailable_reason() is not None:  # bfloat16's "xla" route needs no BLAS
        return out if lhs.dtype == jnp.bfloat16 and bf16_route()[0] == "xla" else None
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
    route = bf16_route()[0] if lhs.dtype == jnp.bfloat16 else "openblas"
    if route == "xla":
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=jnp.float32).astype(out)
    lead = lhs.shape[:-1]
    # bfloat16 as stored for MKL; else float32, exactly, for OpenBLAS
    wide = jnp.bfloat16 if route == "mkl" else jnp.float32
    a = lhs.reshape(-1, lhs.shape[-1]).astype(wide)
    y = _matmul(a, rhs.astype(wide))
    return y.reshape(*lead, rhs.shape[1]).astype(out)


@jax.custom_jvp
def _matmul(a, b):
    """``a [M, K] . b [K, N]`` (float32, or bfloat16 for MKL) into float32, by the BLAS
    on the CPU, by XLA elsewhere."""
    return jax.lax.platform_dependent(a, b, cpu=_blas_matmul, default=_xla_matmul)


def _xla_matmul(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _matmul_jvp(primals, tangents):
    a, b = primals
    # XLA's products, which JAX can transpose (the FFI call it could not); a zero
    # tangent (an input not differentiated) adds no product
    terms = [_xla_matmul(t, b) for t in tangents[:1] if not _zero(t)]
    terms += [_xla_matmul(a, t) for t in tangents[1:] if not _zero(t)]
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
    call = jax.ffi.ffi_call(_target(build.library(), bf16=a.dtype == jnp.bfloat16),
                            jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(a, b)


# ------------------------------------------------ a product with its epilogue fused

def gelu_norm_servable(x, kernel, bias, scale, shift) -> bool:
    """Whether :func:`linear_gelu_norm` runs its fused call here: float32 ``x [..., K]``,
    ``kernel [K, N]`` and ``bias``, ``scale``, ``shift [N]``, non-empty and within
    32-bit BLAS sizes, on the CPU with the BLAS available (as :func:`dot_general`'s
    float32 products)."""
    arrays = (x, kernel, bias, scale, shift)
    if any(jnp.dtype(a.dtype) != jnp.float32 for a in arrays):
        return False
    if x.ndim < 1 or kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
        return False
    n = kernel.shape[1]
    if any(v.shape != (n,) for v in (bias, scale, shift)):
        return False
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    if min(m, kernel.shape[0], n) == 0 or max(m, kernel.shape[0], n) > _INT32_MAX:
        return False
    return jax.default_backend() == "cpu" and unavailable_reason() is None


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def linear_gelu_norm(x, kernel, bias, scale, shift, eps: float, reference):
    """``LayerNorm(gelu(x . kernel + bias)) * scale + shift`` over the last axis
    (``x [..., K]``, ``kernel [K, N]``, the rest ``[N]``; the exact GELU, the biased
    variance, ``eps`` inside the square root) in one call on the CPU: the product on
    the BLAS's GEMM in blocks of rows, each block's epilogue while the block is in the
    cache (``gemm_cpu.cc``, GemmGeluNorm). Call it only where
    :func:`gelu_norm_servable` holds.

    ``reference(x, kernel, bias, scale, shift, eps)`` is the same computation by JAX's
    operations: it runs on other platforms, and its derivatives are this function's
    (a ``custom_jvp``), so only the primal of inference takes the fused call."""
    lead, k = x.shape[:-1], x.shape[-1]
    a = x.reshape(-1, k)

    def fused(a, kernel, bias, scale, shift):
        call = jax.ffi.ffi_call(_target(build.library(), bf16=False, fused=True),
                                jax.ShapeDtypeStruct((a.shape[0], kernel.shape[1]),
                                                     jnp.float32),
                                vmap_method="sequential")
        return call(a, kernel, bias, scale, shift, eps=np.float32(eps))

    def other(a, kernel, bias, scale, shift):
        return reference(a, kernel, bias, scale, shift, eps)

    y = jax.lax.platform_dependent(a, kernel, bias, scale, shift, cpu=fused, default=other)
    return y.reshape(*lead, kernel.shape[1])


@functools.partial(linear_gelu_norm.defjvp, symbolic_zeros=True)
def _linear_gelu_norm_jvp(eps, reference, primals, tangents):
    # the reference's jvp, with the inputs whose tangent is a symbolic zero (not
    # differentiated) held constant, so that no product of a zero tangent is made
    moving = [i for i, t in enumerate(tangents) if not _zero(t)]

    def f(*args):
        full = list(primals)
        for i, a in zip(moving, args):
            full[i] = a
        return reference(*full, eps)

    if not moving:
        y = f()
        return y, jnp.zeros_like(y)
    return jax.jvp(f, [primals[i] for i in moving], [tangents[i] for i in moving])
