"""torchscale's LongNet encoder (Flax NNX), loadable from its PyTorch weights.

``LongNetEncoder(config, rngs=...)`` maps a sequence of embeddings [batch, seq, D] to
torchscale's ``encoder_out`` [batch, seq, D]. It is torchscale's ``Encoder`` with
Sub-LN (``subln=True``: pre-LayerNorm blocks, ``normalize_before=True``, no
DeepNorm), the architecture of LongNet's encoder and of Prov-GigaPath's slide encoder
(:mod:`jax_dilated.models.slide`). With ``x`` the input:

    x = dropout(x)                                           # states[0]
    per layer (i = 0 .. num_layers - 1):
        a = out_proj(inner_attn_ln(dilated(q_proj h, k_proj h, v_proj h)))
                                                  where h = self_attn_layer_norm(x)
        h = x + drop_path_i(dropout(a))
        f = fc2(ffn_layernorm(activation_dropout(gelu(fc1(final_layer_norm(h))))))
        x = h + drop_path_i(dropout(f))                      # states[i + 1]
    encoder_out = layer_norm(x)

``dilated`` is :func:`jax_dilated.dilated_attention` with the config's branches, in
``mode="torchscale"`` by default (what the published weights were trained with:
zero-padded segments inside the softmax, shifted outputs, branch weights without
gradient; docs/semantics.md, section 2). GELU is the exact (erf) one, computed in
float32 at least, as torchscale does (``activation_fn(x.float())``). Every LayerNorm
has ``config.layer_norm_eps`` (torchscale: 1e-5); every projection has a bias.
``drop_path_i`` is stochastic depth per sample at rate
``linspace(0, drop_path_rate, num_layers)[i]`` (kept samples scaled by
``1 / (1 - rate)``).

Parameters keep torchscale's names and one parameter per checkpoint entry (no fused
q/k/v), so :meth:`LongNetEncoder.from_torch_state_dict` maps a torchscale state dict
one to one (``.weight`` of a Linear is the transposed ``kernel``, ``.weight`` of a
LayerNorm its ``scale``) and :meth:`LongNetEncoder.to_state_dict` gives it back.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from jax_dilated.backends.native import gemm
from jax_dilated.backends.registry import IMPLEMENTATIONS
from jax_dilated.core import branch_plans, validation
from jax_dilated.core.branches import is_window
from jax_dilated.core.types import Array, ArrayLike, DTypeLike, Implementation, Mode
from jax_dilated.layers import nnx_rngs
from jax_dilated.ops.dilated import dilated_attention
from jax_dilated.ops.sharded import place, sharded

__all__ = ["LongNetEncoderConfig", "LongNetEncoder"]

# the attention modes the encoder runs ("torchscale": what its checkpoints expect)
ENCODER_MODES = ("longnet", "head_groups", "torchscale")


def _meta(*axes):
    """Logical sharding names of a parameter (annotated, not placed; see jd.nnx)."""
    return {"out_sharding": axes, "eager_sharding": False}


@dataclasses.dataclass(frozen=True)
class LongNetEncoderConfig:
    """Hyper-parameters of :class:`LongNetEncoder` (validated on creation).

    Attributes:
      embed_dim: model width ``D`` (divisible by ``num_heads``).
      num_layers: number of encoder layers (torchscale's ``encoder_layers``).
      num_heads: attention heads ``H`` (``encoder_attention_heads``).
      ffn_dim: hidden width ``F`` of the feed-forward (``encoder_ffn_embed_dim``).
      segment_lengths, dilation_rates: the dilated attention's branches (ints;
        torchscale's ``segment_length`` and ``dilated_ratio``).
      mode: ``"torchscale"`` (default: torchscale's arithmetic, which its
        checkpoints were trained with), ``"longnet"`` (exact LongNet, with
        torchscale's ``"blocked"`` head offsets) or ``"head_groups"``; see
        :func:`jax_dilated.dilated_attention`.
      dropout_rate: dropout on the input embeddings and on both residual branches
        (torchscale's ``dropout``).
      drop_path_rate: stochastic depth of the last layer; layer ``i`` uses
        ``linspace(0, drop_path_rate, num_layers)[i]``.
      attention_dropout_rate: dropout on the attention probabilities.
      activation_dropout_rate: dropout after the GELU.
      layer_norm_eps: epsilon of every LayerNorm (torchscale: 1e-5).
      is_causal: causal attention (torchscale's encoder is not causal).
      dtype: computation dtype (None: that of the parameters). With ``bfloat16`` or
        ``float16`` the projections, the attention and the feed-forward run in it,
        while the LayerNorms, the GELU, the softmax statistics and the residual
        stream stay float32, as under ``torch.autocast``.
      param_dtype: dtype of the parameters.
      implementation: attention kernel (None: chosen by device kind).

    Example:
      >>> import jax_dilated as jd
      >>> cfg = jd.models.LongNetEncoderConfig(embed_dim=32, num_layers=2, num_heads=4,
      ...     ffn_dim=64, segment_lengths=(16, 32), dilation_rates=(1, 2))
      >>> cfg.head_dim, cfg.drop_path_rates
      (8, (0.0, 0.0))
    """

    embed_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: Mode = "torchscale"
    dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    activation_dropout_rate: float = 0.0
    layer_norm_eps: float = 1e-5
    is_causal: bool = False
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    implementation: Implementation | None = None

    def __post_init__(self):
        where = type(self).__name__
        for name in ("embed_dim", "num_layers", "num_heads", "ffn_dim"):
            validation.check_positive_int(f"{where}.{name}", getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{where}.embed_dim ({self.embed_dim}) must be divisible by "
                             f"num_heads ({self.num_heads}).")
        if isinstance(self.segment_lengths, (list, tuple)) and any(
                is_window(w) for w in self.segment_lengths):
            raise ValueError(f"{where}.segment_lengths must hold ints (torchscale's "
                             f"segments), got {self.segment_lengths!r}.")
        try:
            branches = branch_plans.validate_branches(self.segment_lengths,
                                                      self.dilation_rates)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}.{err}") from None
        object.__setattr__(self, "segment_lengths", tuple(w for w, _ in branches))
        object.__setattr__(self, "dilation_rates", tuple(r for _, r in branches))
        if self.mode not in ENCODER_MODES:
            raise ValueError(f"{where}.mode must be one of {ENCODER_MODES}, got {self.mode!r}.")
        if self.mode == "head_groups":  # each branch needs a head group of its own
            try:
                branch_plans.head_groups(self.num_heads, len(branches))
            except ValueError as err:
                raise ValueError(f"{where}.num_heads with mode='head_groups': {err}") from None
        for name in ("dropout_rate", "drop_path_rate", "attention_dropout_rate",
                     "activation_dropout_rate"):
            validation.check_dropout_rate(getattr(self, name), f"{where}.{name}")
        validation.check_positive_float(f"{where}.layer_norm_eps", self.layer_norm_eps)
        validation.check_flag(f"{where}.is_causal", self.is_causal)
        for name in ("dtype", "param_dtype"):
            dtype = getattr(self, name)
            if dtype is None and name == "dtype":
                continue
            if not validation.is_floating_dtype(dtype):
                raise TypeError(f"{where}.{name} must be a floating dtype"
                                f"{' or None' if name == 'dtype' else ''}, got {dtype!r}.")
        if self.implementation not in (None,) + IMPLEMENTATIONS:
            raise ValueError(f"{where}.implementation must be one of "
                             f"{(None,) + IMPLEMENTATIONS}, got {self.implementation!r}.")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def drop_path_rates(self) -> tuple[float, ...]:
        """The stochastic-depth rate of every layer (torchscale's
        ``np.linspace(0, drop_path_rate, num_layers)``)."""
        return tuple(float(p) for p in np.linspace(0.0, self.drop_path_rate, self.num_layers))

    def replace(self, **changes) -> "LongNetEncoderConfig":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------ modules


def _scaled_uniform(bound: float):
    """``U(-bound, bound)``, drawn as ``U(-1, 1) * bound`` (one compiled draw per shape
    and dtype, not per bound)."""
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -1.0, 1.0) * jnp.asarray(bound, dtype)
    return init


def _linear(cfg: LongNetEncoderConfig, n_in: int, n_out: int, axes, *, gain: float,
            init: str, rngs: nnx.Rngs, dot_general) -> nnx.Linear:
    """A biased Linear ``n_in -> n_out``, initialised as torchscale does (``init=
    "torchscale"``: torch's default ``U(+-1/sqrt(n_in))`` for weight and bias, times
    ``gain``) or as Prov-GigaPath's ``initialize_vit_weights`` (``"vit"``:
    xavier-uniform weight, zero bias), its product by ``dot_general``
    (:func:`jax_dilated.backends.native.gemm.for_mesh`)."""
    if init == "vit":
        kernel_init = _scaled_uniform(math.sqrt(6.0 / (n_in + n_out)))
        bias_init = jax.nn.initializers.zeros
    else:
        kernel_init = bias_init = _scaled_uniform(gain / math.sqrt(n_in))
    return nnx.Linear(n_in, n_out, use_bias=True, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, kernel_init=kernel_init,
                      bias_init=bias_init, kernel_metadata=_meta(*axes),
                      bias_metadata=_meta(axes[1]), dot_general=dot_general, rngs=rngs)


def _layer_norm(cfg: LongNetEncoderConfig, n: int, axis: str, rngs: nnx.Rngs,
                eps: float | None = None) -> nnx.LayerNorm:
    # dtype=None: computed in the promotion of the input and float32 parameters
    # (float32 for a bfloat16 input, as torch.autocast runs layer_norm), two-pass
    # variance as torch computes it
    return nnx.LayerNorm(n, epsilon=cfg.layer_norm_eps if eps is None else eps, dtype=None,
                         param_dtype=cfg.param_dtype, use_fast_variance=False,
                         scale_metadata=_meta(axis), bias_metadata=_meta(axis), rngs=rngs)


class _DropPath(nnx.Module):
    """Stochastic depth per sample: ``x * keep / (1 - rate)`` with ``keep`` one
    Bernoulli(1 - rate) draw per batch row (timm's ``drop_path``)."""

    def __init__(self, rate: float, rngs: nnx.Rngs):
        self.rate = rate
        self.rngs = nnx_rngs.fork_dropout_rngs(rngs, rate)

    def __call__(self, x, *, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        keep_prob = 1.0 - self.rate
        keep = jax.random.bernoulli(self.rngs(), keep_prob, (x.shape[0],) + (1,) * (x.ndim - 1))
        return x * (keep.astype(x.dtype) / jnp.asarray(keep_prob, x.dtype))


class _SelfAttention(nnx.Module):
    """torchscale's ``DilatedAttention`` module with Sub-LN: ``[B, L, D] -> [B, L, D]``,
    ``out_proj(inner_attn_ln(attend(q_proj x, k_proj x, v_proj x)))``."""

    def __init__(self, cfg: LongNetEncoderConfig, init: str, rngs: nnx.Rngs, dot_general):
        d, gamma = cfg.embed_dim, _subln_gain(cfg)
        dense = functools.partial(_linear, cfg, init=init, rngs=rngs, dot_general=dot_general)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.dropout_rate = cfg.attention_dropout_rate
        self.k_proj = dense(d, d, ("embed", "heads"), gain=1.0)
        self.v_proj = dense(d, d, ("embed", "heads"), gain=gamma)
        self.q_proj = dense(d, d, ("embed", "heads"), gain=1.0)
        self.out_proj = dense(d, d, ("heads", "embed"), gain=gamma)
        self.inner_attn_ln = _layer_norm(cfg, d, "heads", rngs)
        self.rngs = nnx_rngs.fork_dropout_rngs(rngs, self.dropout_rate)

    def __call__(self, x, *, attend, deterministic: bool):
        b, t, d = x.shape
        heads = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(x).reshape(heads)
        k = self.k_proj(x).reshape(heads)
        v = self.v_proj(x).reshape(heads)
        key = None if deterministic or self.dropout_rate == 0.0 else self.rngs()
        o = attend(q, k, v, dropout_rng=key)  # [B, L, H, d]
        return self.out_proj(self.inner_attn_ln(o.reshape(b, t, d)))


class _FeedForward(nnx.Module):
    """``fc2(ffn_layernorm(activation_dropout(gelu(fc1 x))))`` then dropout."""

    def __init__(self, cfg: LongNetEncoderConfig, init: str, rngs: nnx.Rngs, dot_general):
        d, f, gamma = cfg.embed_dim, cfg.ffn_dim, _subln_gain(cfg)
        dense = functools.partial(_linear, cfg, gain=gamma, init=init, rngs=rngs,
                                  dot_general=dot_general)
        self.fc1 = dense(d, f, ("embed", "mlp"))
        self.fc2 = dense(f, d, ("mlp", "embed"))
        self.ffn_layernorm = _layer_norm(cfg, f, "mlp", rngs)
        self.activation_dropout_module = nnx.Dropout(cfg.activation_dropout_rate, rngs=rngs)
        self.dropout_module = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x, *, deterministic: bool):
        fc1, norm = self.fc1, self.ffn_layernorm
        dropped = not deterministic and self.activation_dropout_module.rate > 0.0
        parts = (x, fc1.kernel[...], fc1.bias[...], norm.scale[...], norm.bias[...])
        if (not dropped and fc1.dot_general is gemm.dot_general
                and fc1.dtype in (None, jnp.float32) and gemm.gelu_norm_servable(*parts)):
            # float32 on one CPU: fc1, the GELU and ffn_layernorm in one call (the
            # epilogue while the product's rows are in the cache); same values
            h = gemm.linear_gelu_norm(*parts, norm.epsilon, _fc1_gelu_norm)
        else:
            h = self.fc1(x)
            # exact GELU in float32 at least (torchscale: activation_fn(x.float()).type_as(x))
            h = _exact_gelu(h.astype(jnp.promote_types(h.dtype, jnp.float32))).astype(h.dtype)
            h = self.activation_dropout_module(h, deterministic=deterministic)
            h = norm(h)
        return self.dropout_module(self.fc2(h), deterministic=deterministic)


def _fc1_gelu_norm(x: Array, kernel: Array, bias: Array, scale: Array, shift: Array,
                   eps: float) -> Array:
    """``_FeedForward``'s fc1, GELU and ffn_layernorm (float32, no dropout) by JAX's
    operations: the fused call's reference, whose derivatives it takes. The LayerNorm
    is ``nnx.LayerNorm``'s with ``use_fast_variance=False`` (``_layer_norm``)."""
    h = gemm.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + bias
    g = _exact_gelu(h)
    centred = g - jnp.mean(g, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(var + eps) * scale + shift


def _exact_gelu(x: Array) -> Array:
    """The exact GELU in torch's form, ``x (1 + erf(x / sqrt(2))) / 2``. On a CPU it is
    about a fifth faster than ``jax.nn.gelu(approximate=False)``, which uses erfc. The
    two forms differ by at most about one rounding of ``x``, where ``1 + erf`` cancels
    (negative ``x``)."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * np.asarray(math.sqrt(0.5), x.dtype)))


class _EncoderLayer(nnx.Module):
    """One Sub-LN encoder layer ``[B, L, D] -> [B, L, D]`` (the module docstring)."""

    def __init__(self, cfg: LongNetEncoderConfig, depth: int, init: str, rngs: nnx.Rngs,
                 dot_general):
        self.self_attn = _SelfAttention(cfg, init, rngs, dot_general)
        self.self_attn_layer_norm = _layer_norm(cfg, cfg.embed_dim, "embed", rngs)
        self.dropout_module = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
        self.drop_path = _DropPath(cfg.drop_path_rates[depth], rngs)
        self.ffn = _FeedForward(cfg, init, rngs, dot_general)
        self.final_layer_norm = _layer_norm(cfg, cfg.embed_dim, "embed", rngs)

    def __call__(self, x, *, attend, deterministic: bool):
        a = self.self_attn(self.self_attn_layer_norm(x), attend=attend,
                           deterministic=deterministic)
        a = self.dropout_module(a, deterministic=deterministic)
        h = x + self.drop_path(a, deterministic=deterministic)
        f = self.ffn(self.final_layer_norm(h), deterministic=deterministic)
        return h + self.drop_path(f, deterministic=deterministic)


def _subln_gain(cfg: LongNetEncoderConfig) -> float:
    """torchscale's Sub-LN initialisation gain of v_proj, out_proj, fc1 and fc2."""
    return math.sqrt(math.log(2 * cfg.num_layers))


# ------------------------------------------------------------- torch state dicts


def _torch_layout(module: nnx.Module) -> dict[str, tuple[tuple, bool]]:
    """``{torch name: (nnx path, transposed)}`` of every parameter of ``module``.

    A path's last element is renamed: ``kernel`` (a Linear's, [in, out]) is the
    transposed ``weight`` ([out, in]), a LayerNorm's ``scale`` is ``weight``; other
    names (``bias``, ``cls_token``) stay. Integer path elements (layer indices) print
    as they are: ``layers.3.self_attn.q_proj.weight``.
    """
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        last = {"kernel": "weight", "scale": "weight"}.get(path[-1], path[-1])
        name = ".".join(str(p) for p in path[:-1] + (last,))
        out[name] = (tuple(path), path[-1] == "kernel")
    return out


def _is_torch_tensor(value) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach")


def to_numpy(value, name: str) -> np.ndarray:
    """A state-dict entry as a NumPy array: a torch tensor (torch imported only then;
    bfloat16 / float16 tensors widened to float32, which holds them exactly), a NumPy
    or JAX array, or anything ``np.asarray`` takes. ``TypeError`` naming the entry
    when it is not a floating array."""
    if _is_torch_tensor(value):
        import torch  # only ever reached with a tensor in hand: torch is installed
        tensor = value.detach().cpu()
        if tensor.dtype in (torch.bfloat16, torch.float16):
            tensor = tensor.float()
        array = tensor.numpy()
    else:
        try:
            array = np.asarray(value)
        except Exception as err:  # noqa: BLE001 (reported with the entry's name)
            raise TypeError(f"state_dict[{name!r}] is not an array ({type(value).__name__}: "
                            f"{err}).") from None
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype == jnp.bfloat16):
        raise TypeError(f"state_dict[{name!r}] must be a floating array, got dtype "
                        f"{array.dtype} ({type(value).__name__}).")
    return array


def _shown(names) -> str:
    names = sorted(names)
    return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")


def check_state_dict(state_dict, expected: dict[str, tuple[int, ...]], *, what: str
                     ) -> dict[str, np.ndarray]:
    """``state_dict`` as ``{name: np.ndarray}`` after checking it holds exactly the
    ``expected`` names with their shapes.

    Raises:
      TypeError: ``state_dict`` is not a mapping, or an entry is not a floating array.
      ValueError: listing by name every missing entry, every unexpected one and every
        one of another shape (with both shapes), all at once.
    """
    if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
        raise TypeError(f"state_dict must be a mapping of parameter names to arrays, got "
                        f"{type(state_dict).__name__}.")
    names = [str(k) for k in state_dict.keys()]
    missing = [n for n in expected if n not in state_dict]
    unexpected = [n for n in names if n not in expected]
    arrays, misshaped = {}, []
    for name in expected:
        if name in state_dict:
            arrays[name] = to_numpy(state_dict[name], name)
            if tuple(arrays[name].shape) != tuple(expected[name]):
                misshaped.append(f"{name} (expected {tuple(expected[name])}, got "
                                 f"{tuple(arrays[name].shape)})")
    problems = []
    if missing:
        problems.append(f"missing: {_shown(missing)}")
    if unexpected:
        problems.append(f"unexpected: {_shown(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped: {_shown(misshaped)}")
    if problems:
        raise ValueError(f"state_dict does not match {what}: " + "; ".join(problems) + ".")
    return arrays


def expected_shapes(module: nnx.Module) -> dict[str, tuple[int, ...]]:
    """``{torch name: torch shape}`` of every parameter of ``module``."""
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    out = {}
    for name, (path, transposed) in _torch_layout(module).items():
        shape = tuple(params[path].shape)  # (also of an abstract module, nnx.eval_shape)
        out[name] = shape[::-1] if transposed else shape
    return out


def load_arrays(module: nnx.Module, arrays: dict[str, np.ndarray]) -> None:
    """Set every parameter of ``module`` from its torch-named, torch-shaped entry of
    ``arrays`` (checked beforehand), cast to the parameter's dtype."""
    state = nnx.state(module, nnx.Param)
    params = dict(nnx.to_flat_state(state))
    for name, (path, transposed) in _torch_layout(module).items():
        var = params[path]
        value = arrays[name].T if transposed else arrays[name]
        var[...] = jnp.asarray(np.ascontiguousarray(value), var[...].dtype)
    nnx.update(module, state)


def state_dict_of(module: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter of ``module`` as a NumPy array under its torch name and shape."""
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    out = {}
    for name, (path, transposed) in _torch_layout(module).items():
        value = np.asarray(params[path][...])
        out[name] = np.ascontiguousarray(value.T if transposed else value)
    return out


# ------------------------------------------------------------------------ encoder


class LongNetEncoder(nnx.Module):
    """torchscale's LongNet encoder (Sub-LN, pre-LayerNorm, final LayerNorm), Flax NNX.

    Args:
      config: a :class:`LongNetEncoderConfig`.
      rngs: ``nnx.Rngs`` (``params`` for initialisation, ``dropout`` for dropout,
        attention dropout and drop-path).
      mesh, seq_axis: sequence parallelism: the tokens sharded over the mesh axis
        ``seq_axis`` (or a pair of axes, as one), each attention layer run by
        :func:`jax_dilated.sharded` (``strategy="auto"``; torchscale's attention
        runs as the whole sequence of ``H / P`` heads per device), the rest token by
        token on the shards. A sequence whose length the devices do not divide is
        padded (torchscale: ``valid_length``; the other modes: a padding mask) and
        cut back: the result equals one device's.

    Call: ``enc(x [B, L, D], *, return_states=False, deterministic=True)``:
    torchscale's ``encoder_out`` [B, L, D], or with ``return_states=True`` the pair
    ``(encoder_out, states)`` with the ``num_layers + 1`` states [B, L, D] of
    torchscale's ``encoder_states`` (``states[0]`` the input after the input dropout,
    ``states[i + 1]`` layer ``i``'s output, none of them through the final
    LayerNorm). ``deterministic=False`` applies the dropouts and drop-path with keys
    from the ``dropout`` stream of ``rngs``.

    Dtypes: the residual stream, the states and the output are in the promotion of
    the input's dtype and ``param_dtype`` (float32 for float32 parameters, whatever
    ``config.dtype``; float64 for a float64 model); the LayerNorms and the GELU compute
    in it (at least float32) and the projections, the attention and the feed-forward's
    matrix products in ``config.dtype`` (the attention's softmax statistics in float32
    at least), as ``torch.autocast`` runs torchscale.

    Parameters (torchscale's names, ``.weight`` of a Linear being the transposed
    ``kernel``, of a LayerNorm its ``scale``): ``layers[i].self_attn.{q,k,v,out}_proj``
    (kernel [D, D], bias [D]), ``layers[i].self_attn.inner_attn_ln``,
    ``layers[i].self_attn_layer_norm``, ``layers[i].ffn.fc1`` ([D, F]),
    ``layers[i].ffn.ffn_layernorm`` ([F]), ``layers[i].ffn.fc2`` ([F, D]),
    ``layers[i].final_layer_norm``, ``layer_norm``. Initialised as torchscale
    initialises them: torch's default ``nn.Linear`` initialisation with
    ``v_proj``, ``out_proj``, ``fc1`` and ``fc2`` (weights and biases) scaled by
    ``sqrt(log(2 num_layers))`` (Sub-LN), LayerNorms at scale 1 and bias 0.

    Example:
      >>> import jax, jax.numpy as jnp, jax_dilated as jd
      >>> from flax import nnx
      >>> cfg = jd.models.LongNetEncoderConfig(embed_dim=32, num_layers=2, num_heads=4,
      ...     ffn_dim=64, segment_lengths=(16, 32), dilation_rates=(1, 2))
      >>> enc = jd.models.LongNetEncoder(cfg, rngs=nnx.Rngs(0))
      >>> x = jax.random.normal(jax.random.key(0), (1, 40, 32), jnp.float32)
      >>> out, states = nnx.jit(lambda m, x: m(x, return_states=True))(enc, x)
      >>> out.shape, len(states)
      ((1, 40, 32), 3)
    """

    def __init__(self, config: LongNetEncoderConfig, *, rngs: nnx.Rngs,
                 mesh: jax.sharding.Mesh | None = None,
                 seq_axis: str | tuple[str, str] | None = None, _init: str = "torchscale"):
        # _init="vit": Prov-GigaPath's initialisation (SlideEncoder builds it so)
        if not isinstance(config, LongNetEncoderConfig):
            raise TypeError(f"config must be a LongNetEncoderConfig, got "
                            f"{type(config).__name__}.")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}.")
        validation.check_mesh_axes(mesh, seq_axis)
        self.config = config
        self.mesh = mesh
        self.seq_axis = tuple(seq_axis) if isinstance(seq_axis, list) else seq_axis
        self.dropout_module = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.layers = nnx.List([_EncoderLayer(config, i, _init, rngs, gemm.for_mesh(mesh))
                                for i in range(config.num_layers)])
        self.layer_norm = _layer_norm(config, config.embed_dim, "embed", rngs)

    # ------------------------------------------------------------------ forward

    def __call__(self, x: ArrayLike, *, return_states: bool = False,
                 deterministic: bool = True) -> Array | tuple[Array, list[Array]]:
        """``x`` [B, L, D] -> ``encoder_out`` [B, L, D], or ``(encoder_out, states)``
        with ``return_states`` (see the class docstring)."""
        validation.check_flag("return_states", return_states)
        validation.check_flag("deterministic", deterministic)
        cfg = self.config
        if (getattr(x, "ndim", None) != 3 or not jnp.issubdtype(x.dtype, jnp.floating)
                or x.shape[-1] != cfg.embed_dim or 0 in x.shape):
            raise ValueError(
                f"x must be a floating array [batch, seq, embed_dim={cfg.embed_dim}] with "
                f"no empty dimension, got {getattr(x, 'dtype', type(x).__name__)} "
                f"{tuple(getattr(x, 'shape', ()))}.")
        x = jnp.asarray(x)
        x = x.astype(jnp.promote_types(x.dtype, cfg.param_dtype))
        length = x.shape[1]
        if self.mesh is not None:
            x = self._shard(x)
        x = self.dropout_module(x, deterministic=deterministic)
        attend = functools.partial(self._attention, length=length)
        states = [x]
        for layer in self.layers:
            x = layer(x, attend=attend, deterministic=deterministic)
            states.append(x)
        out = self.layer_norm(x)
        if x.shape[1] != length:  # the padding of a mesh whose devices do not divide L
            out, states = out[:, :length], [s[:, :length] for s in states]
        return (out, states) if return_states else out

    @property
    def _auto_mesh(self) -> jax.sharding.Mesh:
        """The mesh with Auto axes: the encoder's token-wise steps (the padding's cut, a
        pooled token) then index the sharded sequence as XLA's partitioner sees fit,
        where Explicit axes (``jax.make_mesh``'s) would refuse an ambiguous gather."""
        return jax.sharding.Mesh(self.mesh.devices, self.mesh.axis_names,
                                 axis_types=(AxisType.Auto,) * len(self.mesh.axis_names))

    def _seq_devices(self) -> tuple[tuple[str, ...], int]:
        """The mesh axes the sequence is sharded over (a pair in the mesh's order, as
        :func:`jax_dilated.sharded` runs one-axis strategies over it) and their size."""
        names = self.seq_axis if isinstance(self.seq_axis, tuple) else (self.seq_axis,)
        axes = tuple(a for a in self.mesh.axis_names if a in names)
        return axes, math.prod(self.mesh.shape[a] for a in axes)

    def _shard(self, x: Array) -> Array:
        """``x`` [B, L, D] padded to a multiple of the sequence's devices and sharded
        over them (the padding's tokens are left out of every attention: their
        outputs are dropped at the end)."""
        axes, size = self._seq_devices()
        pad = -x.shape[1] % size
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad), (0, 0)])
        return place(x, self._auto_mesh,
                     PartitionSpec(None, axes if len(axes) > 1 else axes[0], None))

    def _attention(self, q: Array, k: Array, v: Array, *, length: int,
                   dropout_rng: Array | None = None) -> Array:
        """The dilated attention of every layer: q, k, v [B, L', H, d] -> [B, L', H, d]
        (attention dropout at ``config.attention_dropout_rate`` when a key is given).
        ``length``: the sequence's own length ``L`` (``L' > L`` on a mesh whose devices
        do not divide it: the tokens past ``L`` are padding)."""
        cfg = self.config
        options = {"head_offsets": "blocked"} if cfg.mode == "longnet" else {}
        padded = q.shape[1] != length
        if padded and cfg.mode == "torchscale":
            options["valid_length"] = length  # torchscale's segments depend on L
        fn = functools.partial(
            dilated_attention, segment_lengths=cfg.segment_lengths,
            dilation_rates=cfg.dilation_rates, mode=cfg.mode, is_causal=cfg.is_causal,
            dropout_rate=cfg.attention_dropout_rate if dropout_rng is not None else 0.0,
            dropout_rng=dropout_rng, implementation=cfg.implementation, **options)
        if self.mesh is None:
            return fn(q, k, v)
        # the other modes leave the padding out by its mask (they are exact on it)
        kv_mask = (jnp.broadcast_to(jnp.arange(q.shape[1]) < length, q.shape[:2])
                   if padded and cfg.mode != "torchscale" else None)
        run = sharded(fn, self._auto_mesh, seq_axis=self.seq_axis, strategy="auto")
        return run(q, k, v, kv_mask=kv_mask)

    # -------------------------------------------------------------- checkpoints

    @classmethod
    def from_torch_state_dict(cls, state_dict, config: LongNetEncoderConfig, *,
                              rngs: nnx.Rngs | None = None,
                              mesh: jax.sharding.Mesh | None = None,
                              seq_axis: str | tuple[str, str] | None = None,
                              dtype: DTypeLike | None = None) -> "LongNetEncoder":
        """An encoder holding the weights of a torchscale ``Encoder``'s state dict.

        Args:
          state_dict: ``{name: array}`` with torchscale's names
            (``layers.{i}.self_attn.q_proj.weight``, ..., ``layer_norm.bias``) and
            shapes (a Linear's weight [out, in]); values are NumPy arrays, torch
            tensors (torch is imported only to read them) or anything ``np.asarray``
            takes. Exactly the encoder's entries: nothing is ignored.
          config: the matching :class:`LongNetEncoderConfig`.
          rngs: the model's random streams (dropout, drop-path); default
            ``nnx.Rngs(0)``.
          mesh, seq_axis: as in the constructor.
          dtype: the computation dtype (overrides ``config.dtype``).

        Returns:
          the encoder, its parameters in ``config.param_dtype``.

        Raises:
          ValueError: naming every missing, unexpected or mis-shaped entry.
          TypeError: an entry is not a floating array.
        """
        if not isinstance(config, LongNetEncoderConfig):
            raise TypeError(f"config must be a LongNetEncoderConfig, got "
                            f"{type(config).__name__}.")
        if dtype is not None:
            config = config.replace(dtype=dtype)
        model = cls(config, rngs=nnx.Rngs(0) if rngs is None else rngs, mesh=mesh,
                    seq_axis=seq_axis)
        arrays = check_state_dict(state_dict, expected_shapes(model),
                                  what=f"a LongNetEncoder with {config.num_layers} layers, "
                                       f"embed_dim {config.embed_dim}, ffn_dim "
                                       f"{config.ffn_dim}")
        load_arrays(model, arrays)
        return model

    def to_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as ``{torchscale name: np.ndarray}`` (torch shapes, the
        parameter dtype): :meth:`from_torch_state_dict` takes it back, and
        ``torch_module.load_state_dict({k: torch.from_numpy(v) ...})`` loads it."""
        return state_dict_of(self)

