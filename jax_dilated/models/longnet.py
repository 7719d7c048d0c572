"""LongNet: a decoder-only language model on dilated attention (Flax NNX).

``LongNetLM(config, rngs=...)`` maps tokens [batch, seq] to logits [batch, seq,
vocab]. Each of ``num_layers`` blocks is

    x = x + Dropout(Attention(LN(x)))       # jd.nnx.MultiheadDilatedAttention, causal
    x = x + Dropout(FeedForward(LN(x)))     # GELU or SwiGLU

with rotary or xPos positions applied to the projected queries and keys. Two
normalisation schemes (``config.norm``):

* ``"pre"``: pre-LayerNorm blocks (the attention layer without its sub-LN),
  Xavier-normal initialisation with gain 1;
* ``"sub"``: MAGNETO / Sub-LN, as in LongNet: also a LayerNorm before the output
  projection of the attention (the layer's ``layer_norm=True``) and before the
  second linear map of the feed-forward, and the value / output / feed-forward
  weights initialised with gain ``gamma = sqrt(log(2 num_layers))``.

Tokens are embedded by a table with entries of standard deviation ``embed_dim^-1/2``
scaled by ``sqrt(embed_dim)`` (unit-scale inputs), and a final LayerNorm precedes the
output head, which is the transposed embedding (``tie_embeddings=True``) or its own
matrix.

* Sequence parallelism: ``LongNetLM(config, mesh=..., seq_axis=...)`` runs every
  attention layer as distributed dilated attention over the mesh (equal to the
  single-device model); ``seq_axis=(a, b)`` shards the sequence over two mesh axes
  with the ``"hybrid"`` strategy (heads exchanged over ``a``, a ring over ``b``;
  docs/semantics.md section 8, "Hybrid"); everything else is token-wise and follows
  the input's sharding.
* Rematerialisation: ``config.remat=True`` recomputes each block in the backward pass
  (``nnx.remat``): activations of only the block boundaries are kept.
* Decoding: :meth:`LongNetLM.init_cache` + ``model(tokens, decode=True)`` run on the
  layers' KV caches (a prompt at once, then one token at a time);
  :meth:`LongNetLM.generate` does greedy or temperature sampling in one compiled loop.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dilated.backends.native import gemm
from jax_dilated.core import validation
from jax_dilated.core.types import Array, ArrayLike, DTypeLike, StrategyLike
from jax_dilated.layers import nnx as jd_nnx
from jax_dilated.layers import projections
from jax_dilated.layers.common import check_decode_segment_ids, mesh_strategy
from jax_dilated.models.config import LongNetConfig

__all__ = ["LongNetLM", "cross_entropy"]

def _meta(*axes):
    """Logical sharding names of a parameter (annotated, not placed; see jd.nnx)."""
    return {"out_sharding": axes, "eager_sharding": False}


class _FeedForward(nnx.Module):
    """``[B, T, E] -> [B, T, E]``: GELU (``fc2(gelu(fc1 x))``) or SwiGLU
    (``fc2(silu(fc1 x) * gate x)``), with a LayerNorm before ``fc2`` under Sub-LN."""

    def __init__(self, cfg: LongNetConfig, rngs: nnx.Rngs, dot_general):
        e, f = cfg.embed_dim, cfg.hidden_dim
        init = projections.xavier_normal(cfg.gamma, 0, 1)
        dense = functools.partial(nnx.Linear, use_bias=cfg.use_bias, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, kernel_init=init,
                                  dot_general=dot_general, rngs=rngs)
        self.fc1 = dense(e, f, kernel_metadata=_meta("embed", "mlp"),
                         bias_metadata=_meta("mlp"))
        self.gate = (dense(e, f, kernel_metadata=_meta("embed", "mlp"),
                           bias_metadata=_meta("mlp")) if cfg.ffn == "swiglu" else None)
        self.ln = (nnx.LayerNorm(f, epsilon=cfg.layer_norm_eps, dtype=cfg.dtype,
                                 param_dtype=cfg.param_dtype, scale_metadata=_meta("mlp"),
                                 bias_metadata=_meta("mlp"), rngs=rngs)
                   if cfg.norm == "sub" else None)
        self.fc2 = dense(f, e, kernel_metadata=_meta("mlp", "embed"),
                         bias_metadata=_meta("embed"))

    def __call__(self, x):
        h = self.fc1(x)
        if self.gate is None:
            h = jax.nn.gelu(h)
        else:
            h = jax.nn.silu(h) * self.gate(x)
        if self.ln is not None:
            h = self.ln(h)
        return self.fc2(h)


class _Block(nnx.Module):
    """One decoder block ``[B, T, E] -> [B, T, E]`` (see the module docstring)."""

    def __init__(self, cfg: LongNetConfig, *, mesh, seq_axis, batch_axis, strategy,
                 rngs: nnx.Rngs):
        ln = functools.partial(nnx.LayerNorm, cfg.embed_dim, epsilon=cfg.layer_norm_eps,
                               dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                               scale_metadata=_meta("embed"), bias_metadata=_meta("embed"),
                               rngs=rngs)
        self.ln_attn = ln()
        self.attn = jd_nnx.MultiheadDilatedAttention(
            cfg.embed_dim, cfg.num_heads, segment_lengths=cfg.segment_lengths,
            dilation_rates=cfg.dilation_rates, num_kv_heads=cfg.num_kv_heads, mode=cfg.mode,
            head_offsets=cfg.head_offsets, dropout_rate=cfg.attention_dropout_rate,
            use_bias=cfg.use_bias, layer_norm=cfg.norm == "sub",
            layer_norm_eps=cfg.layer_norm_eps, gamma_init=cfg.gamma, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, implementation=cfg.implementation,
            block_q=cfg.block_q, block_k=cfg.block_k, mesh=mesh,
            seq_axis=seq_axis, batch_axis=batch_axis, strategy=strategy,
            qk_transform=cfg.qk_transform(),
            logit_soft_cap=cfg.logit_soft_cap, sinks=cfg.attention_sinks,
            deterministic=False, rngs=rngs)
        self.ln_ffn = ln()
        self.ffn = _FeedForward(cfg, rngs, gemm.for_mesh(mesh))
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x, *, kv_mask=None, segment_ids=None, decode=False,
                 deterministic=None):
        h = self.attn(self.ln_attn(x), is_causal=True, kv_mask=kv_mask,
                      segment_ids=segment_ids, decode=decode, deterministic=deterministic)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.ffn(self.ln_ffn(x))
        return x + self.dropout(h, deterministic=deterministic)


def _run_block(block, x, kv_mask, segment_ids, deterministic):
    return block(x, kv_mask=kv_mask, segment_ids=segment_ids, deterministic=deterministic)


_run_block_remat = nnx.remat(_run_block, static_argnums=(4,))


def _poison_out_of_vocab(tokens, x, vocab_size: int):
    """``x`` [B, T, E] with NaN at tokens outside ``[0, vocab_size)``.

    A lookup would otherwise read a wrong row silently (a negative id wraps to the
    end of the table). Concrete ids out of range raise here; traced ones (under
    ``jit``) cannot, so their embeddings become NaN and so does every logit they
    reach: never a plausible wrong number.
    """
    if not isinstance(tokens, jax.core.Tracer):
        # numpy, not jnp: under an enclosing jit a closed-over concrete array would
        # still give traced comparisons.
        ids = np.asarray(tokens)
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            shown = sorted({int(i) for i in ids[bad]})[:5]
            raise ValueError(f"tokens must be ids in [0, vocab_size={vocab_size}), got "
                             f"{shown} (tokens {tuple(ids.shape)}).")
        return x
    bad = (tokens < 0) | (tokens >= vocab_size)
    return jnp.where(bad[..., None], jnp.asarray(jnp.nan, x.dtype), x)


class LongNetLM(nnx.Module):
    """Decoder-only LongNet language model (Flax NNX).

    Args:
      config: a :class:`LongNetConfig`.
      mesh, seq_axis: run every attention layer sequence-parallel over ``mesh``
        (distributed dilated attention with the sequence sharded on ``seq_axis``;
        the sequence length must then divide by its size); ``batch_axis`` also
        shards the batch. Inputs and outputs stay global arrays. ``seq_axis=(a, b)``
        names two mesh axes: the sequence sharded over both (``b`` major, the length
        divisible by ``P_a P_b``), heads exchanged over ``a`` (``num_heads``
        divisible by ``P_a``), a ring over ``b`` (docs/semantics.md section 8,
        "Hybrid"); the logits and gradients are those of the single-device model.
      strategy: how each attention layer runs over the mesh (see
        :func:`jax_dilated.sharded`): None (default) is ``"ring"`` for one axis and
        ``"hybrid"`` for a pair; also ``"allgather"``, ``"heads"``, ``"auto"`` or a
        tuple with one per branch (one axis), ``"auto"`` (a pair: it picks
        ``"hybrid"``).
      rngs: ``nnx.Rngs`` (``params`` for initialisation, ``dropout`` for dropout).

    Call: ``model(tokens [B, T] int, *, kv_mask=None [B, T] bool, segment_ids=None
    [B, T] int, decode=False, deterministic=None) -> logits [B, T, V]`` (float32, or
    float64 for a float64 model). Logits at ``t`` depend on
    tokens ``0..t`` only (causal). ``segment_ids`` packs documents into a row (a
    document is a maximal run of equal ids): attention stays inside each document
    and rotary / xPos positions count from its first token, so the logits of a
    packed row are those of each document run alone (not with ``decode``). ``decode=True`` runs the next tokens against the
    KV cache of :meth:`init_cache` (a prompt at once, then token by token; each
    token at its absolute position). ``deterministic=True`` disables dropout (None:
    the modules' defaults, i.e. dropout on; ``nnx.view(model, deterministic=True)``
    or ``model.eval()`` change them).

    Parameters: ``embed.embedding`` [V, E] (``("vocab", "embed")``); per block
    ``blocks[i]``: ``ln_attn``, ``attn`` (see
    :class:`jax_dilated.nnx.MultiheadDilatedAttention`; with
    ``config.attention_sinks``, ``attn.sinks.logit`` [H]), ``ln_ffn``, ``ffn.fc1``
    [E, F], (``ffn.gate`` [E, F]), (``ffn.ln``), ``ffn.fc2`` [F, E]; ``final_ln``;
    ``head.kernel`` [E, V] when embeddings are untied.

    Example:
      >>> import jax.numpy as jnp, jax_dilated as jd
      >>> from flax import nnx
      >>> cfg = jd.models.LongNetConfig(vocab_size=32, embed_dim=16, num_layers=1,
      ...                               num_heads=2, segment_lengths=(8, 32),
      ...                               dilation_rates=(1, 2))
      >>> model = jd.models.LongNetLM(cfg, rngs=nnx.Rngs(0))
      >>> tokens = jnp.arange(32)[None] % 32                    # [batch, seq]
      >>> nnx.jit(lambda m, t: m(t, deterministic=True))(model, tokens).shape
      (1, 32, 32)
      >>> model.generate(tokens[:, :4], max_new_tokens=3).shape   # KV-cache decoding
      (1, 7)
    """

    def __init__(self, config: LongNetConfig, *, mesh: jax.sharding.Mesh | None = None,
                 seq_axis: str | tuple[str, str] | None = None,
                 batch_axis: str | None = None, strategy: StrategyLike | None = None,
                 rngs: nnx.Rngs):
        if not isinstance(config, LongNetConfig):
            raise TypeError(f"config must be a LongNetConfig, got {type(config).__name__}.")
        validation.check_mesh_axes(mesh, seq_axis, batch_axis)
        strategy = mesh_strategy(seq_axis, strategy)
        self.config = config
        e, v = config.embed_dim, config.vocab_size
        init = jax.nn.initializers.normal(e ** -0.5)
        self.embed = nnx.Embed(v, e, dtype=config.dtype, param_dtype=config.param_dtype,
                               embedding_init=init, embedding_metadata=_meta("vocab", "embed"),
                               rngs=rngs)
        self.embed_dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.blocks = nnx.List([_Block(config, mesh=mesh, seq_axis=seq_axis,
                                       batch_axis=batch_axis, strategy=strategy, rngs=rngs)
                                for _ in range(config.num_layers)])
        self.final_ln = nnx.LayerNorm(e, epsilon=config.layer_norm_eps, dtype=config.dtype,
                                      param_dtype=config.param_dtype,
                                      scale_metadata=_meta("embed"),
                                      bias_metadata=_meta("embed"), rngs=rngs)
        self.head = None if config.tie_embeddings else nnx.Linear(
            e, v, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype,
            kernel_init=init, kernel_metadata=_meta("embed", "vocab"),
            dot_general=gemm.for_mesh(mesh), rngs=rngs)

    # ------------------------------------------------------------------ forward

    def __call__(self, tokens: ArrayLike, *, kv_mask: ArrayLike | None = None,
                 segment_ids: ArrayLike | None = None, decode: bool = False,
                 deterministic: bool | None = None) -> Array:
        """``tokens`` [B, T] int -> logits [B, T, V] (at least float32; see the class
        docstring)."""
        if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an int array [batch, seq], got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                f"{tuple(getattr(tokens, 'shape', ()))}.")
        if decode:
            check_decode_segment_ids(segment_ids)
        # checked here too, so that a bad shape names the tokens it was paired with
        segment_ids = validation.check_segment_ids(segment_ids, tokens.shape, tokens.shape)
        cfg = self.config
        x = self.embed(tokens) * jnp.asarray(math.sqrt(cfg.embed_dim),
                                             cfg.dtype or cfg.param_dtype)
        x = _poison_out_of_vocab(tokens, x, cfg.vocab_size)
        x = self.embed_dropout(x, deterministic=deterministic)
        for block in self.blocks:
            if decode:
                x = block(x, kv_mask=kv_mask, decode=True, deterministic=deterministic)
            elif cfg.remat:
                x = _run_block_remat(block, x, kv_mask, segment_ids, deterministic)
            else:
                x = _run_block(block, x, kv_mask, segment_ids, deterministic)
        x = self.final_ln(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))

    # ----------------------------------------------------------------- decoding

    def init_cache(self, batch_size: int, max_len: int | None = None,
                   dtype: DTypeLike | None = None) -> None:
        """Allocate every attention layer's KV cache for ``max_len`` tokens (default
        ``config.max_len``); ``dtype`` defaults to the computation dtype."""
        cfg = self.config
        max_len = cfg.max_len if max_len is None else max_len
        dtype = dtype or cfg.dtype or cfg.param_dtype
        for block in self.blocks:
            block.attn.init_cache((batch_size, max_len, cfg.embed_dim), dtype)

    def generate(self, prompt: ArrayLike, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, rng: Array | None = None,
                 max_len: int | None = None, cache_dtype: DTypeLike | None = None,
                 return_logits: bool = False) -> Array | tuple[Array, Array]:
        """Continue ``prompt`` by ``max_new_tokens`` tokens using the KV cache.

        The prompt fills a fresh cache in one causal pass; the new tokens are then
        decoded one per step in a compiled ``lax.scan``. The model itself is not
        modified (the cache lives inside the compiled function).

        Args:
          prompt: int [B, P], ``P >= 1``.
          max_new_tokens: ``N >= 1``.
          temperature: 0 for greedy decoding (argmax), > 0 to sample from
            ``softmax(logits / temperature)``.
          top_k: sample among the ``top_k`` most likely tokens only.
          rng: a ``jax.random`` key (required when sampling).
          max_len: cache length, default ``P + N``.
          cache_dtype: dtype of the cache (default: the computation dtype).
          return_logits: also return the logits each new token was chosen from.

        Returns:
          tokens int32 [B, P + N] (the prompt followed by the new tokens), and with
          ``return_logits`` the logits [B, N, V] float32.
        """
        prompt = jnp.asarray(prompt)
        if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype,
                                                                          jnp.integer):
            raise ValueError(f"prompt must be an int array [batch, prompt_len >= 1], got "
                             f"{prompt.dtype} {tuple(prompt.shape)}.")
        max_new_tokens = validation.check_positive_int("max_new_tokens", max_new_tokens)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float >= 0, got {temperature!r}.")
        if not temperature >= 0:
            raise ValueError(f"temperature must be a float >= 0, got {temperature!r}.")
        sample = temperature > 0
        if top_k is not None:
            top_k = validation.check_positive_int("top_k", top_k)
            if top_k > self.config.vocab_size:
                raise ValueError(f"top_k must be None or an int in [1, vocab_size="
                                 f"{self.config.vocab_size}], got {top_k!r}.")
        if top_k is not None and not sample:
            raise ValueError("top_k is for sampling: pass a temperature > 0.")
        if sample and rng is None:
            raise ValueError("sampling (temperature > 0) needs rng= (a jax.random key).")
        total = prompt.shape[1] + max_new_tokens
        max_len = total if max_len is None else max_len
        if max_len < total:
            raise ValueError(f"max_len={max_len} is shorter than prompt + new tokens "
                             f"({prompt.shape[1]} + {max_new_tokens}).")
        cfg = self.config
        cache_dtype = jnp.dtype(cache_dtype or cfg.dtype or cfg.param_dtype)
        rng = jax.random.key(0) if rng is None else rng
        graphdef, state = nnx.split(self)
        tokens, logits = _generate(graphdef, state, prompt.astype(jnp.int32), rng,
                                   jnp.asarray(temperature if sample else 1.0, jnp.float32),
                                   max_new_tokens=max_new_tokens, max_len=max_len,
                                   sample=sample, top_k=top_k, cache_dtype=cache_dtype)
        return (tokens, logits) if return_logits else tokens


def _pick(logits, key, temperature, sample: bool, top_k):
    """The next token [B] from logits [B, V]."""
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len",
                                             "sample", "top_k", "cache_dtype"))
def _generate(graphdef, state, prompt, rng, temperature, *, max_new_tokens, max_len,
              sample, top_k, cache_dtype):
    model = nnx.merge(graphdef, state)
    model.init_cache(prompt.shape[0], max_len, cache_dtype)
    logits = model(prompt, decode=True, deterministic=True)[:, -1]
    rng, key = jax.random.split(rng)
    token = _pick(logits, key, temperature, sample, top_k)
    step_def, step_state = nnx.split(model)

    def step(carry, _):
        st, tok, rng = carry
        m = nnx.merge(step_def, st)
        logits_t = m(tok[:, None], decode=True, deterministic=True)[:, 0]
        rng, key = jax.random.split(rng)
        nxt = _pick(logits_t, key, temperature, sample, top_k)
        return (nnx.split(m)[1], nxt, rng), (nxt, logits_t)

    _, (tokens, all_logits) = jax.lax.scan(step, (step_state, token, rng), None,
                                           length=max_new_tokens - 1)
    tokens = jnp.concatenate([prompt, token[:, None], tokens.swapaxes(0, 1)], axis=1)
    all_logits = jnp.concatenate([logits[:, None], all_logits.swapaxes(0, 1)], axis=1)
    return tokens, all_logits


def cross_entropy(logits: ArrayLike, targets: ArrayLike,
                  weights: ArrayLike | None = None) -> Array:
    """Mean next-token cross-entropy.

    Args:
      logits: [B, T, V] (computed in at least float32).
      targets: int [B, T].
      weights: optional [B, T] (e.g. 0/1: which positions count).

    Returns:
      scalar: ``sum(w * nll) / sum(w)`` (the plain mean without weights).

    Example:
      >>> import jax.numpy as jnp, jax_dilated as jd
      >>> logits = jnp.zeros((1, 2, 4))                          # uniform over 4 tokens
      >>> round(float(jd.models.cross_entropy(logits, jnp.array([[0, 3]]))), 4)  # log 4
      1.3863
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                              axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(nll.dtype)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1e-9)
