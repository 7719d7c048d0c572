"""Trace-time checks of user input; every message names the argument, the value and what is allowed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["axis_size", "check_qkv", "check_kv_mask", "check_dropout", "check_scale", "default_scale"]


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


def check_dropout(dropout_rate, dropout_rng) -> float:
    """Rate in ``[0, 1)``; a key is required when the rate is positive."""
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)):
        raise TypeError(f"dropout_rate must be a Python float, got {dropout_rate!r}.")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}.")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(
            f"dropout_rate={dropout_rate} needs a dropout_rng (a jax.random key), got None."
        )
    return float(dropout_rate)


def check_scale(scale, head_dim: int) -> float:
    """``scale`` is None (``1/sqrt(head_dim)``) or a positive Python number."""
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a Python float, got {scale!r}.")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}.")
    return float(scale)


def default_scale(head_dim: int) -> float:
    return float(head_dim) ** -0.5


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a Python bool, got {value!r}.")
    return value


def axis_size(axis_name, caller: str) -> int:
    """Size of the bound mesh axis ``axis_name``; a clear error when it is not bound."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: call {caller} inside jax.shard_map "
            f"over a mesh with that axis, or use jd.sharded(...) on global arrays ({err})."
        ) from None
