"""Trace-time checks of user input; every message names the argument, the value and what is allowed."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["axis_size", "check_qkv", "check_kv_mask", "check_segment_ids", "check_dropout",
           "check_dropout_rate", "check_scale", "check_scale_option", "default_scale", "check_flag",
           "check_positive_int", "check_positive_float", "check_block_sizes",
           "check_nonnegative_int", "check_position", "check_mesh_axes", "check_mesh_axis",
           "check_axis_pair", "check_max_documents",
           "renamed", "warn_renamed", "check_window", "check_logit_soft_cap", "check_sinks"]


# ------------------------------------------------------------------- deprecations


def warn_renamed(old: str, new: str, where: str, stacklevel: int = 3):
    """Warn that ``old`` (an argument or a value) is deprecated in favour of ``new``."""
    warnings.warn(f"{where}: {old} is deprecated and will be removed in the next release; "
                  f"use {new} (same meaning).", DeprecationWarning, stacklevel=stacklevel)


def renamed(old_value, new_value, *, old: str, new: str, where: str, stacklevel: int = 4):
    """The value of an argument renamed from ``old`` to ``new``.

    The deprecated spelling defaults to None: when it was given, warn
    (``DeprecationWarning`` naming ``new``) and return it; giving both is a
    ``TypeError``. ``stacklevel`` counts from here to the user's call.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{where} got both {old}= and {new}= ({old}= is the deprecated "
                        f"spelling of {new}=): pass {new}= only.")
    warn_renamed(f"{old}=", f"{new}=", where, stacklevel)
    return old_value


# --------------------------------------------------------------------- scalars


def check_positive_int(name: str, value) -> int:
    """``value`` is a Python / NumPy int > 0 (TypeError for another type, ValueError
    for a value <= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r} "
                        f"({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def check_nonnegative_int(name: str, value) -> int:
    """``value`` is a Python / NumPy int >= 0 (TypeError for another type, ValueError
    for a negative value)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a non-negative int, got {value!r} "
                        f"({type(value).__name__}).")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}.")
    return int(value)


def check_positive_float(name: str, value) -> float:
    """``value`` is a Python number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                         np.floating)):
        raise TypeError(f"{name} must be a positive float, got {value!r} "
                        f"({type(value).__name__}).")
    if not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}.")
    return float(value)


def is_floating_dtype(dtype) -> bool:
    """Whether ``dtype`` names a floating dtype (False for anything that is no dtype)."""
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))
    except TypeError:
        return False


def check_block_sizes(block_q, block_k) -> tuple[int | None, int | None]:
    """Kernel block sizes: None (the kernel's default) or positive ints."""
    return tuple(None if b is None else check_positive_int(name, b)
                 for name, b in (("block_q", block_q), ("block_k", block_k)))


def check_qkv(query, key, value) -> tuple[int, int, int, int, int]:
    """Check ``[batch, seq, heads, head_dim]`` inputs (GQA allowed).

    Returns ``(batch, q_len, num_heads, num_kv_heads, kv_len)``.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}.")
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape "
                f"{tuple(x.shape)} (rank {x.ndim})."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}.")
        empty = [dim for dim, n in zip(("batch", "seq", "heads", "head_dim"), x.shape)
                 if n == 0]
        if empty:
            # One policy for every entry point (docs/semantics.md, section 1): an empty
            # dimension is an error, never an empty or NaN result.
            raise ValueError(
                f"{name} has an empty {' and '.join(empty)} dimension: shape "
                f"{tuple(x.shape)} [batch, seq, heads, head_dim]; every dimension must "
                f"be at least 1.")
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}."
        )
    b, t, h, d = query.shape
    if key.shape[0] != b:
        raise ValueError(
            f"query and key must have the same batch size, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
    if key.shape[3] != d:
        raise ValueError(
            f"query and key must have the same head_dim, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}."
        )
    hkv = key.shape[2]
    if h % hkv:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads (grouped-query attention), "
            f"got query with {h} heads and key/value with {hkv} heads."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} "
            f"and {value.dtype}."
        )
    return b, t, h, hkv, key.shape[1]


def check_kv_mask(kv_mask, batch: int, kv_len: int):
    """``kv_mask`` must be None or bool ``[batch, kv_len]``."""
    if kv_mask is None:
        return None
    if not hasattr(kv_mask, "dtype") or kv_mask.dtype != jnp.bool_:
        raise TypeError(
            f"kv_mask must be a bool array [batch, seq] (True = may be attended to), got "
            f"{getattr(kv_mask, 'dtype', type(kv_mask).__name__)}."
        )
    if tuple(kv_mask.shape) != (batch, kv_len):
        raise ValueError(
            f"kv_mask must have shape [batch, seq] = {(batch, kv_len)}, got "
            f"{tuple(kv_mask.shape)}."
        )
    return kv_mask


def check_segment_ids(segment_ids, query_shape, key_shape):
    """``segment_ids`` must be None or an integer array ``[batch, seq]`` matching the
    query and the key (one id array serves both, so their lengths must be equal).
    Returns it as int32, or None."""
    if segment_ids is None:
        return None
    dtype = getattr(segment_ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"segment_ids must be an integer array [batch, seq] (document ids), got "
            f"{dtype if dtype is not None else type(segment_ids).__name__}.")
    batch, q_len, k_len = query_shape[0], query_shape[1], key_shape[1]
    if q_len != k_len:
        raise ValueError(
            f"segment_ids needs query and key of the same length (one id array serves "
            f"both), got query {tuple(query_shape)} and key {tuple(key_shape)}.")
    if tuple(segment_ids.shape) != (batch, q_len):
        raise ValueError(
            f"segment_ids must have shape [batch, seq] = {(batch, q_len)} (query "
            f"{tuple(query_shape)}), got {tuple(segment_ids.shape)}.")
    return jnp.asarray(segment_ids, jnp.int32)


def check_dropout_rate(dropout_rate, name: str = "dropout_rate") -> float:
    """A dropout rate: a Python float in ``[0, 1)``."""
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)):
        raise TypeError(f"{name} must be a Python float in [0, 1), got {dropout_rate!r}.")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_rate!r}.")
    return float(dropout_rate)


def check_dropout(dropout_rate, dropout_rng) -> float:
    """Rate in ``[0, 1)``; a key is required when the rate is positive."""
    dropout_rate = check_dropout_rate(dropout_rate)
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(
            f"dropout_rate={dropout_rate} needs a dropout_rng (a jax.random key), got None."
        )
    return float(dropout_rate)


def check_scale_option(scale) -> float | None:
    """``scale`` is None (the default ``1/sqrt(head_dim)``) or a positive, finite
    Python number (``inf`` would turn every logit into ``inf`` or NaN)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer,
                                                         np.floating)):
        raise TypeError(f"scale must be None or a positive Python float, got {scale!r}.")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be positive and finite (or None for "
                         f"1/sqrt(head_dim)), got {scale!r}.")
    return float(scale)


def check_scale(scale, head_dim: int) -> float:
    """``scale`` is None (``1/sqrt(head_dim)``) or a positive Python number."""
    scale = check_scale_option(scale)
    return default_scale(head_dim) if scale is None else scale


def default_scale(head_dim: int) -> float:
    return float(head_dim) ** -0.5


def check_position(position, length: int, name: str = "position"):
    """A token position ``0 <= position < length``: an int scalar, concrete or traced.

    Returns ``(p, bad)``: ``p`` the position as an int32 scalar, clipped into
    ``[0, length)`` so that it can index; ``bad`` None when the position was checked
    here (a Python int or a concrete array: out of range is a ``ValueError``), or,
    for a traced position, a bool scalar that is True when it is out of range (the
    caller turns its result into NaN rather than a silently wrong number).
    A float or bool position is a ``TypeError``, a non-scalar one a ``ValueError``.
    """
    if isinstance(position, bool) or not isinstance(position, (int, np.integer,
                                                               np.ndarray, jax.Array)):
        raise TypeError(f"{name} must be an int scalar (Python int or int array of "
                        f"shape ()), got {position!r} ({type(position).__name__}).")
    if isinstance(position, (np.ndarray, jax.Array)):
        if position.ndim != 0:
            raise ValueError(f"{name} must be a scalar (one position for the whole "
                             f"batch), got shape {tuple(position.shape)}.")
        if not jnp.issubdtype(position.dtype, jnp.integer):
            raise TypeError(f"{name} must have an integer dtype, got {position.dtype}.")
    if isinstance(position, jax.core.Tracer):
        p = position.astype(jnp.int32)
        return jnp.clip(p, 0, length - 1), (p < 0) | (p >= length)
    if not 0 <= int(position) < length:
        raise ValueError(f"{name} must be in [0, {length}) (the cache holds {length} "
                         f"slots), got {int(position)}.")
    return jnp.asarray(int(position), jnp.int32), None


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a Python bool, got {value!r}.")
    return value


# ------------------------------------------------------------------ mesh and axes


def axis_size(seq_axis, caller: str) -> int:
    """Size of the bound mesh axis ``seq_axis``; a clear error when it is not bound."""
    try:
        return jax.lax.axis_size(seq_axis)
    except NameError as err:
        raise ValueError(
            f"seq_axis={seq_axis!r} is not bound: call {caller} inside jax.shard_map "
            f"over a mesh with that axis, or use jd.sharded(...) on global arrays ({err})."
        ) from None


def check_mesh_axis(mesh, name: str, axis):
    """``axis`` (the argument ``name``) is None or an axis of ``mesh``."""
    if axis is not None and axis not in mesh.axis_names:
        raise ValueError(
            f"{name}={axis!r} is not an axis of the mesh; its axes are "
            f"{tuple(mesh.axis_names)}."
        )


def check_axis_pair(seq_axis) -> tuple[str, str]:
    """``seq_axis`` as the pair ``(a, b)`` of the ``"hybrid"`` strategy (heads exchanged
    over ``a``, a ring over ``b``); a ``ValueError`` naming it unless it is two
    different axis names."""
    axes = tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else None
    if axes is None or len(axes) != 2 or not all(isinstance(x, str) for x in axes):
        raise ValueError(f"seq_axis must name one mesh axis, or two as (a, b) for "
                         f"strategy='hybrid' (heads exchanged over a, a ring over b), got "
                         f"{seq_axis!r}.")
    if axes[0] == axes[1]:
        raise ValueError(f"seq_axis={seq_axis!r} names the same mesh axis twice: give two "
                         f"different axes (a, b), or one axis alone.")
    return axes


def check_mesh_axes(mesh, seq_axis, batch_axis=None, head_axis=None):
    """A mesh and its sequence axis come together; every named axis exists and they
    are different axes (``mesh=None`` with no axis named is one device). ``seq_axis``
    may be a pair of axes ``(a, b)`` (the ``"hybrid"`` strategy)."""
    if isinstance(seq_axis, (tuple, list)):
        for axis in check_axis_pair(seq_axis):
            check_mesh_axes(mesh, axis, batch_axis, head_axis)
        return
    named = (("seq_axis", seq_axis), ("batch_axis", batch_axis), ("head_axis", head_axis))
    if mesh is None:
        for name, axis in named:
            if axis is not None:
                raise ValueError(f"{name}={axis!r} was given without a mesh: pass mesh= too.")
        return
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if seq_axis is None:
        raise ValueError(
            f"a mesh was given without seq_axis: name the mesh axis to shard the "
            f"sequence over (one of {tuple(mesh.axis_names)})."
        )
    for name, axis in named:
        check_mesh_axis(mesh, name, axis)
    axes = [axis for _, axis in named if axis is not None]
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"seq_axis, batch_axis and head_axis must be different mesh axes, got "
            f"seq_axis={seq_axis!r}, batch_axis={batch_axis!r}, head_axis={head_axis!r}."
        )


# --------------------------------------- sliding windows, soft-capping, sinks


def check_window(window, is_causal: bool = False) -> tuple[int, int] | None:
    """``window``: None or a pair ``(left, right)`` of non-negative Python/NumPy ints
    (the meaning of ``jax.nn.dot_product_attention``'s ``local_window_size``);
    with ``is_causal`` the right extent must be 0 (causality already forbids every
    later key). Returns ``(left, right)`` as ints, or None."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of non-negative "
                        f"ints, got {window!r} ({type(window).__name__}).")
    left, right = (check_nonnegative_int(f"window[{i}]", w) for i, w in enumerate(window))
    if is_causal and right > 0:
        raise ValueError(f"window={tuple(window)!r} has right={right} > 0 with "
                         f"is_causal=True: causal attention sees no later key; use "
                         f"window=({left}, 0).")
    return left, right


def check_logit_soft_cap(logit_soft_cap) -> float | None:
    """``logit_soft_cap``: None or a finite Python number > 0 (static: it is part of
    the compiled program)."""
    if logit_soft_cap is None:
        return None
    if isinstance(logit_soft_cap, bool) or not isinstance(
            logit_soft_cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"logit_soft_cap must be None or a finite Python float > 0, got "
                        f"{logit_soft_cap!r} ({type(logit_soft_cap).__name__}).")
    if not (math.isfinite(float(logit_soft_cap)) and logit_soft_cap > 0):
        raise ValueError(f"logit_soft_cap must be a finite float > 0, got "
                         f"{logit_soft_cap!r}.")
    return float(logit_soft_cap)


def check_sinks(sinks, num_heads: int):
    """``sinks``: None or a floating array ``[num_heads]`` (one learnable logit per
    query head). Returned as a JAX array, or None."""
    if sinks is None:
        return None
    dtype = getattr(sinks, "dtype", None)
    if dtype is None or not is_floating_dtype(dtype):
        raise TypeError(f"sinks must be a floating array [num_heads] = [{num_heads}] (one "
                        f"logit per query head), got "
                        f"{dtype if dtype is not None else type(sinks).__name__}.")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape [num_heads] = ({num_heads},), got "
                         f"{tuple(sinks.shape)}.")
    return jnp.asarray(sinks)


def check_valid_length(valid_length, seq_len: int) -> int | None:
    """``valid_length`` (torchscale's padded sequences): an int in ``[1, seq_len]``
    (a ``ValueError`` otherwise); None when it is the whole sequence."""
    if (isinstance(valid_length, bool) or not isinstance(valid_length, (int, np.integer))
            or not 1 <= valid_length <= seq_len):
        raise ValueError(f"valid_length must be an int in [1, {seq_len}] (the sequence "
                         f"length), got {valid_length!r}.")
    return None if valid_length == seq_len else int(valid_length)


def check_max_documents(max_documents) -> None:
    """``max_documents``: None or a positive int (ValueError otherwise)."""
    if max_documents is not None and (isinstance(max_documents, bool)
                                      or not isinstance(max_documents, int)
                                      or max_documents < 1):
        raise ValueError(f"max_documents must be None or a positive int, got "
                         f"{max_documents!r}.")
