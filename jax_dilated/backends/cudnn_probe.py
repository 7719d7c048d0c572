"""What the installed JAX offers the cuDNN backend: its fused-attention module, the
private backward primitive's parameters, the cuDNN version.

Imported by :mod:`.selection` (can this machine run cuDNN at all?) and by
:mod:`.cudnn` (binding the primitive); it imports neither, so the two do not import
each other. Nothing here touches a device: the checks read JAX's modules and
signatures only, so they run (and are tested) on CPU.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["fused_module", "backward_parameters", "primitive_signature_reason",
           "cudnn_software_reason", "cudnn_version", "BWD_ARRAYS", "BWD_UNUSED",
           "BWD_PARAMS", "BWD_SPREAD"]

# Parameters of the private backward primitive that the cudnn backend knows how to
# fill: the arrays it passes, the optional arrays it leaves empty, the static params.
BWD_ARRAYS = ("query", "key", "value", "activation", "fwd_output", "grad_output")
BWD_UNUSED = ("bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
              "page_table_v")
BWD_PARAMS = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
              "sliding_window_length", "score_mod")
# Array parameters spread positionally (jax 0.12's score_mod_args, flex attention's
# operands): this backend has none, so they contribute no positional arrays.
BWD_SPREAD = ("score_mod_args",)


def fused_module():
    """``jax._src.cudnn.fused_attention_stablehlo`` (imported when first needed)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused
    return fused


def backward_parameters() -> list[str]:
    """Parameter names, in order, of this JAX's private cuDNN backward implementation."""
    return list(inspect.signature(fused_module()._dot_product_attention_bwd_impl).parameters)


@functools.lru_cache(maxsize=None)
def primitive_signature_reason() -> str | None:
    """Why this JAX's cuDNN backward primitive cannot be bound here, or None."""
    try:
        fused = fused_module()
        fused._dot_product_attention_bwd_p_wrapper  # noqa: B018 - presence check
        fused.dot_product_attention  # noqa: B018
        names = backward_parameters()
    except Exception as e:
        return f"this JAX's cuDNN attention internals are not the expected ones ({e})"
    unknown = [n for n in names if n not in BWD_ARRAYS + BWD_UNUSED + BWD_PARAMS + BWD_SPREAD]
    missing = [n for n in BWD_ARRAYS if n not in names]
    if unknown or missing:
        return (f"this JAX's cuDNN backward primitive has parameters {names}; the cudnn "
                f"backend does not know {unknown} / misses {missing}")
    return None


@functools.lru_cache(maxsize=None)
def cudnn_software_reason() -> str | None:
    """Why this JAX cannot run the cuDNN backend, or None.

    Checks that JAX was built with cuDNN and that its fused-attention module has
    the public forward and the backward primitive the backend binds, with the
    parameters it knows (the private signature has changed between releases).
    """
    try:
        fused = fused_module()
    except Exception as e:  # pragma: no cover - jax without the module
        return f"this JAX has no cuDNN fused-attention module ({type(e).__name__}: {e})"
    if getattr(fused, "cuda_versions", None) is None:
        return "this JAX was installed without CUDA/cuDNN (jaxlib CPU-only build)"
    return primitive_signature_reason()


def cudnn_version() -> int | None:
    """The cuDNN version this JAX was built against (e.g. 91100), or None if unknown."""
    try:
        from jax._src.lib import cuda_versions
        return None if cuda_versions is None else int(cuda_versions.cudnn_get_version())
    except Exception:  # pragma: no cover - informational
        return None
