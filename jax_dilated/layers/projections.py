"""The parameters and the projections of the multi-head layers (NNX and Linen alike).

* :class:`HeadsConfig` - the multi-head options, their validation and the table of
  parameters (:func:`param_specs`: shapes, initialisers, logical sharding axes);
* the functional forward pass around the attention: :func:`project_qkv`,
  :func:`project_out` (with the MAGNETO sub-LayerNorm), and the optional
  ``qk_transform`` (e.g. rotary embeddings) between them.

Logical axis names of the parameters (map them to mesh axes with
``nnx.logical_axis_rules`` / ``flax.linen.logical_axis_rules``):

=============  ===============================================================
``"embed"``     the model (embedding) dimension ``embed_dim``
``"heads"``     query heads (shard over a tensor-parallel axis, e.g. ``"model"``)
``"kv_heads"``  key/value heads (``num_kv_heads``; must divide by that axis too)
``"head_dim"``  features per head
=============  ===============================================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax_dilated.core import branch_plans, softmax, validation
from jax_dilated.layers.common import AttentionCore
from jax_dilated.core.documents import document_starts

__all__ = ["HeadsConfig", "ParamSpec", "param_specs", "sink_logits", "project_qkv", "project_out",
           "check_qk_transform", "apply_qk_transform", "xavier_normal"]

# logical sharding axes of the parameters
EMBED, HEADS, KV_HEADS, HEAD_DIM = "embed", "heads", "kv_heads", "head_dim"
# ----------------------------------------------------------------------- heads, params


def xavier_normal(gain: float, in_axis, out_axis):
    """Xavier (Glorot) normal with ``gain``: std ``gain * sqrt(2 / (fan_in + fan_out))``."""
    return jax.nn.initializers.variance_scaling(gain ** 2, "fan_avg", "normal",
                                                in_axis=in_axis, out_axis=out_axis)


class ParamSpec(NamedTuple):
    """One parameter: ``name`` inside its group, ``shape``, ``init(key, shape, dtype)``,
    logical sharding ``axes`` (one name per dimension)."""

    name: str
    shape: tuple
    init: Callable
    axes: tuple


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """Validated multi-head options (see the layers' docstrings)."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    use_bias: bool = True
    layer_norm: bool = True
    layer_norm_eps: float = 1e-5
    gamma_init: float = 1.0
    sinks: bool = False

    @classmethod
    def create(cls, embed_dim, num_heads, num_kv_heads=None, *, use_bias=True,
               layer_norm=True, layer_norm_eps=1e-5, gamma_init=1.0, sinks=False):
        embed_dim = validation.check_positive_int("embed_dim", embed_dim)
        num_heads = validation.check_positive_int("num_heads", num_heads)
        num_kv_heads = validation.check_positive_int(
            "num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} "
                f"and num_heads={num_heads}.")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads (grouped-query attention), "
                f"got num_heads={num_heads} and num_kv_heads={num_kv_heads}.")
        layer_norm_eps = validation.check_positive_float("layer_norm_eps", layer_norm_eps)
        gamma_init = validation.check_positive_float("gamma_init", gamma_init)
        use_bias = validation.check_flag("use_bias", use_bias)
        layer_norm = validation.check_flag("layer_norm", layer_norm)
        if not isinstance(sinks, bool):
            raise TypeError(
                f"sinks must be a Python bool (True: a learnable [num_heads] sink logit "
                f"per head), got {type(sinks).__name__} {getattr(sinks, 'shape', sinks)!r};"
                f" for fixed sink logits call the attention function with sinks=.")
        return cls(embed_dim, num_heads, num_kv_heads, use_bias, layer_norm,
                   float(layer_norm_eps), float(gamma_init), sinks)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def check_core(self, core: AttentionCore):
        """Combinations of heads and attention that cannot work, caught at construction."""
        opts = dict(core.options)
        if opts.get("mode") == "head_groups":
            branch_plans.head_groups(self.num_heads, len(opts["segment_lengths"]))
        if core.head_axis is not None:
            size = core.mesh.shape[core.head_axis]
            if self.num_heads % size or self.num_kv_heads % size:
                raise ValueError(
                    f"head_axis={core.head_axis!r} has {size} devices: num_heads "
                    f"({self.num_heads}) and num_kv_heads ({self.num_kv_heads}) must both "
                    f"be divisible by it.")


def param_specs(cfg: HeadsConfig) -> dict[str, tuple[ParamSpec, ...]]:
    """The parameters of a multi-head layer, by group (``query``, ``key``, ``value``,
    ``sub_ln``, ``out``, ``sinks``), in creation order.

    Projections are Xavier-normal with gain 1 (query, key) or ``gamma_init`` (value,
    out), as LongNet / MAGNETO prescribe; biases are zero; the sub-LayerNorm starts at
    scale 1, bias 0. Kernel shapes: ``query`` [embed, heads, head_dim], ``key`` /
    ``value`` [embed, kv_heads, head_dim], ``out`` [heads, head_dim, embed].

    With ``cfg.sinks``: ``sinks.logit`` [heads] (``("heads",)``), the per-head sink
    logit joining every row's softmax denominator (docs/semantics.md, "Sliding
    windows, soft-capping and sinks"). It starts at 0: at initialisation the sink
    weighs as much as one key whose logit is 0 (the logit of orthogonal q and k), so
    every row can already put some weight on "nothing", and its gradient is nonzero
    from the first step (a very negative start would leave the sink unused and its
    gradient vanishing).
    """
    e, h, hkv, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones

    def proj(heads, heads_axis, gain):
        specs = [ParamSpec("kernel", (e, heads, d), xavier_normal(gain, 0, (1, 2)),
                           (EMBED, heads_axis, HEAD_DIM))]
        if cfg.use_bias:
            specs.append(ParamSpec("bias", (heads, d), zeros, (heads_axis, HEAD_DIM)))
        return tuple(specs)

    out = [ParamSpec("kernel", (h, d, e), xavier_normal(cfg.gamma_init, (0, 1), 2),
                     (HEADS, HEAD_DIM, EMBED))]
    if cfg.use_bias:
        out.append(ParamSpec("bias", (e,), zeros, (EMBED,)))
    groups = {"query": proj(h, HEADS, 1.0), "key": proj(hkv, KV_HEADS, 1.0),
              "value": proj(hkv, KV_HEADS, cfg.gamma_init)}
    if cfg.layer_norm:
        groups["sub_ln"] = (ParamSpec("scale", (h, d), ones, (HEADS, HEAD_DIM)),
                            ParamSpec("bias", (h, d), zeros, (HEADS, HEAD_DIM)))
    groups["out"] = tuple(out)
    if cfg.sinks:  # last, so that the other parameters draw the same keys as without
        groups["sinks"] = (ParamSpec("logit", (h,), zeros, (HEADS,)),)
    return groups


def sink_logits(params):
    """The layer's sink logits ``[heads]`` (``params["sinks"]["logit"]``), or None
    for a layer without sinks. Passed in the parameter dtype: the sink joins the
    softmax statistics, which are float32 (or float64) whatever the compute dtype."""
    return params["sinks"]["logit"] if "sinks" in params else None


# ---------------------------------------------------------------------- forward pass


def _promote(dtype, *xs):
    """Cast arrays to ``dtype`` (default: their common result type), as flax does."""
    dtype = jnp.result_type(*xs) if dtype is None else dtype
    return [jnp.asarray(x, dtype) for x in xs]


# the two products of the layers: "bte,ehd->bthd" (in) and "bthd,hde->bte" (out)
_IN, _OUT = "bte,ehd->bthd", "bthd,hde->bte"


def _dense(group, x, subscripts, dtype, precision, dot_general):
    """``x`` times the group's kernel (plus its bias): by ``jnp.einsum``, or with a
    ``dot_general`` (:func:`jax_dilated.backends.native.gemm.for_mesh`) as the one
    matrix product ``[B T, K] . [K, N]`` that each einsum is."""
    kernel = group["kernel"]
    bias = group.get("bias")
    if bias is None:
        x, kernel = _promote(dtype, x, kernel)
    else:
        x, kernel, bias = _promote(dtype, x, kernel, bias)
    if dot_general is None:
        y = jnp.einsum(subscripts, x, kernel, precision=precision)
    else:
        b, t = x.shape[:2]
        n_in = x.shape[2] if subscripts == _IN else x.shape[2] * x.shape[3]
        w = kernel.reshape(n_in, -1)
        y = dot_general(x.reshape(b, t, n_in), w, (((2,), (0,)), ((), ())),
                        precision=precision)
        y = y.reshape(b, t, *kernel.shape[1:]) if subscripts == _IN else y
    return y if bias is None else y + bias


def project_qkv(params, query, key, value, *, dtype=None, precision=None, dot_general=None):
    """``[B, T, E]`` inputs -> q ``[B, T, H, D]``, k / v ``[B, T, Hkv, D]``
    (``dot_general``: see :func:`_dense`; None: ``jnp.einsum``)."""
    return (_dense(params["query"], query, _IN, dtype, precision, dot_general),
            _dense(params["key"], key, _IN, dtype, precision, dot_general),
            _dense(params["value"], value, _IN, dtype, precision, dot_general))


def _sub_layer_norm(group, x, eps, dtype):
    """LayerNorm over the joint (heads, head_dim) features of ``x`` [B, T, H, D]."""
    x, scale, bias = _promote(dtype, x, group["scale"], group["bias"])
    stats = softmax.stats_dtype(x.dtype)
    xs = x.astype(stats)
    mean = jnp.mean(xs, axis=(-2, -1), keepdims=True)
    var = jnp.mean(jnp.square(xs - mean), axis=(-2, -1), keepdims=True)
    y = ((xs - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return y * scale + bias


def project_out(params, cfg: HeadsConfig, attn, *, dtype=None, precision=None,
                dot_general=None):
    """Attention output ``[B, T, H, D]`` -> (sub-LayerNorm) -> ``[B, T, E]``."""
    if cfg.layer_norm:
        attn = _sub_layer_norm(params["sub_ln"], attn, cfg.layer_norm_eps, dtype)
    return _dense(params["out"], attn, _OUT, dtype, precision, dot_general)


# ------------------------------------------------------------------ q/k transform


def check_qk_transform(fn):
    """``qk_transform`` is None or a callable ``(q, k, positions) -> (q, k)``."""
    if fn is not None and not callable(fn):
        raise TypeError(
            f"qk_transform must be None or a callable (q, k, positions) -> (q, k), got "
            f"{type(fn).__name__}.")
    return fn


def apply_qk_transform(fn, q, k, start=0, segment_ids=None):
    """``fn(q, k, positions)`` for the projected ``q`` [B, T, H, D] and ``k``
    [B, T, Hkv, D] of tokens at absolute positions ``start + arange(T)`` (int32
    [T]; ``start`` is the cache index when decoding), e.g. rotary embeddings.
    With ``segment_ids`` (int [B, T], packed documents) the positions count from
    each token's document instead, ``p - start of its document`` (int32 [B, T]; a
    document is a maximal run of equal ids), so a packed row is encoded as its
    documents alone would be. Returns ``(q, k)`` unchanged when ``fn`` is None."""
    if fn is None:
        return q, k
    positions = jnp.asarray(start, jnp.int32) + jnp.arange(q.shape[1], dtype=jnp.int32)
    if segment_ids is not None:
        positions = positions[None, :] - document_starts(segment_ids)
    out = fn(q, k, positions)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and tuple(out[0].shape) == tuple(q.shape)
            and tuple(out[1].shape) == tuple(k.shape)):
        got = ([tuple(getattr(x, "shape", ())) for x in out]
               if isinstance(out, (tuple, list)) else type(out).__name__)
        raise ValueError(
            f"qk_transform must return (q, k) with the shapes it received, "
            f"{tuple(q.shape)} and {tuple(k.shape)}, got {got}.")
    return tuple(out)
