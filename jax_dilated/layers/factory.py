"""The layer factory: :func:`create_multihead_dilated_attention` (alias
:func:`create_multihead_attention`) builds the multi-head layer - dilated,
distributed dilated, ring or block-sparse - that fits the sequence length, the mesh
and the device (``kind="auto"``), and says why. (``attention_fn``, the drop-in for
Flax layers, lives in :mod:`jax_dilated.layers.flax_adapter` and is re-exported
here.)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union, get_args

import jax
from flax import linen as nn
from flax import nnx

from jax_dilated.backends import select_implementation
from jax_dilated.block_patterns import BlockPattern
from jax_dilated.core import validation
from jax_dilated.core.types import ArrayLike, FlaxApi, LayerKind, SegmentLengths
from jax_dilated.layers import common
from jax_dilated.layers import linen as linen_layers
from jax_dilated.layers import nnx as nnx_layers
from jax_dilated.layers.flax_adapter import attention_fn

__all__ = ["attention_fn", "create_multihead_dilated_attention", "create_multihead_attention",
           "choose_kind", "Choice", "KINDS", "MIN_TOKENS_PER_DEVICE"]


# ---------------------------------------------------------------------------- factory


KINDS = get_args(LayerKind)  # ("auto", "dilated", "ring", "distributed", ...)
# deprecated kind names -> their new names
_RENAMED_KINDS = {"ring_dilated": "distributed"}
# what the factory returns: an NNX or a Linen layer
Layer = Union[nnx.Module, nn.Module]

# Below this many tokens per device, sharding the sequence costs more in
# communication than it saves; "auto" keeps such sequences on one device.
MIN_TOKENS_PER_DEVICE = 1024

_DILATED_ONLY = ("segment_lengths", "dilation_rates", "mode", "head_offsets", "dropout_rate",
                 "dropout")
_MESH_KEYS = ("mesh", "seq_axis", "batch_axis", "head_axis", "strategy")


class Choice(NamedTuple):
    """What :func:`create_multihead_dilated_attention` built and why."""

    kind: str
    reason: str

    def __str__(self):
        return f"{self.kind}: {self.reason}"


def _kernel_note(device: jax.Device | None = None) -> str:
    device = device or jax.devices()[0]
    impl = select_implementation(None, device=device)
    return f"kernel {impl!r} for device kind {device.device_kind!r}"


def choose_kind(*, segment_lengths: SegmentLengths | None = None,
                mesh: jax.sharding.Mesh | None = None,
                seq_axis: str | tuple[str, str] | None = None,
                seq_len: int | None = None, device: jax.Device | None = None,
                pattern: BlockPattern | ArrayLike | None = None) -> Choice:
    """The kind ``"auto"`` picks, with the reason.

    * a block ``pattern``: block-sparse attention, ``"block_sparse_ring"`` or
      ``"block_sparse"`` by the same mesh rules as dilated attention below;
    * no ``segment_lengths``: exact attention, ``"ring"`` over the mesh (a mesh is
      then required);
    * a mesh whose ``seq_axis`` has ``P > 1`` devices: ``"distributed"`` (distributed
      dilated attention), unless
      ``seq_len`` is known and not divisible by ``P`` or shorter than
      ``P * MIN_TOKENS_PER_DEVICE`` tokens - then ``"dilated"`` on one device;
    * otherwise ``"dilated"``.

    ``seq_axis`` may name two mesh axes ``(a, b)``: ``P = P_a P_b`` is then the devices
    of both, and the sequence-parallel kinds run the ``"hybrid"`` strategy (heads
    exchanged over ``a``, a ring over ``b``; docs/semantics.md section 8, "Hybrid"),
    the one strategy that runs a pair (:func:`create_multihead_dilated_attention`
    sets it).

    The reason also names the kernel the device kind selects.
    """
    if seq_len is not None:
        validation.check_positive_int("seq_len", seq_len)
    if pattern is not None:
        choice = choose_kind(segment_lengths=(), mesh=mesh, seq_axis=seq_axis,
                             seq_len=seq_len, device=device)
        kind = "block_sparse" if choice.kind == "dilated" else "block_sparse_ring"
        return Choice(kind, f"a block pattern: block-sparse attention; {choice.reason}")
    validation.check_mesh_axes(mesh, seq_axis)
    note = _kernel_note(device if device is not None or mesh is None
                        else mesh.devices.flat[0])
    if mesh is not None:
        pair = isinstance(seq_axis, (tuple, list))
        axes = tuple(seq_axis) if pair else (seq_axis,)
        devices = math.prod(mesh.shape[a] for a in axes)
        named = f"mesh axes {axes!r}" if pair else f"mesh axis {seq_axis!r}"
        where = (f"{named} ({' x '.join(str(mesh.shape[a]) for a in axes)} = {devices} "
                 f"devices; strategy 'hybrid': heads exchanged over {axes[0]!r}, a ring "
                 f"over {axes[1]!r})" if pair else f"{named} ({devices} devices)")
    if segment_lengths is None:
        if mesh is None:
            raise ValueError(
                "kind='auto' needs segment_lengths (dilated attention) or a mesh and "
                "seq_axis (exact ring attention).")
        return Choice("ring", f"no segment_lengths: exact attention, sequence sharded "
                              f"over {where}; {note}")
    if mesh is None:
        return Choice("dilated", f"no mesh: one device; {note}")
    if devices == 1:
        return Choice("dilated", f"{named} has one device; {note}")
    if seq_len is not None:
        if seq_len % devices:
            return Choice("dilated", f"seq_len={seq_len} is not divisible by the {devices} "
                                     f"devices of {named}: one device; {note}")
        if seq_len < devices * MIN_TOKENS_PER_DEVICE:
            return Choice("dilated", f"seq_len={seq_len} gives under "
                                     f"{MIN_TOKENS_PER_DEVICE} tokens per device on "
                                     f"{devices} devices: one device is faster; {note}")
    length = "" if seq_len is None else f"seq_len={seq_len}, "
    return Choice("distributed", f"{length}distributed dilated attention, sequence "
                                 f"sharded over {where}; {note}")


def _layer_classes(api: str):
    apis = {"nnx": nnx_layers, "linen": linen_layers}
    if api not in apis:
        raise ValueError(f"api must be 'nnx' or 'linen', got {api!r}.")
    layers = apis[api]
    return {"dilated": layers.MultiheadDilatedAttention,
            "distributed": layers.MultiheadDilatedAttention,
            "ring": layers.MultiheadRingAttention,
            "block_sparse": layers.MultiheadBlockSparseAttention,
            "block_sparse_ring": layers.MultiheadBlockSparseAttention}


def create_multihead_dilated_attention(kind: LayerKind = "auto", *, api: FlaxApi = "nnx",
                                       seq_len: int | None = None, explain: bool = False,
                                       **config) -> Layer | tuple[Layer, Choice]:
    """Build a multi-head attention layer of the given ``kind``: the factory of every
    multi-head layer (dilated, distributed dilated, ring and block-sparse), also
    available as :func:`create_multihead_attention`.

    Args:
      kind: ``"dilated"`` (one device), ``"distributed"`` (distributed dilated
        attention: the sequence sharded over ``mesh`` / ``seq_axis``; ``"ring_dilated"``
        is its deprecated name), ``"ring"`` (exact attention
        over the mesh; no ``segment_lengths``), ``"block_sparse"`` /
        ``"block_sparse_ring"`` (``block_size`` and ``pattern``; one device / a ring
        over ``mesh``), or ``"auto"`` (see :func:`choose_kind`).
      api: ``"nnx"`` (``jax_dilated.nnx`` layers; pass ``rngs=``) or ``"linen"``.
      seq_len: the sequence length the layer will see, if known (used by ``"auto"``).
      explain: also return the :class:`Choice` (kind and reason).
      **config: the layer's arguments (``embed_dim``, ``num_heads``,
        ``segment_lengths``, ``dilation_rates``, ``mesh``, ``seq_axis``, ``strategy``,
        ``rngs``, ...).

    Two mesh axes: ``seq_axis=(a, b)`` shards the sequence over both (``b`` major; the
    length divisible by ``P_a P_b``) for the sequence-parallel kinds. A ``strategy``
    left out is then ``"hybrid"`` (heads exchanged over ``a``, ``num_heads`` divisible
    by ``P_a``, a ring over ``b``; docs/semantics.md section 8, "Hybrid"), and
    ``strategy="auto"`` picks ``"hybrid"`` too (the one strategy that runs a pair);
    ``kind="auto"`` counts the devices of both axes (see :func:`choose_kind`). The
    layer computes what the same layer computes on one device. With one axis a
    ``strategy`` left out is the layers' default, ``"ring"``.

    Returns:
      The layer, or ``(layer, choice)`` with ``explain=True``.

    Raises:
      TypeError / ValueError: for a ``seq_len`` that is not a positive int.
      ValueError: for an unknown kind, a ring kind without a mesh,
        a mesh without the named axis (or a pair naming one axis twice),
        ``"dilated"`` with a mesh, ``"ring"`` with dilated-attention options.

    Example:
      >>> import jax_dilated as jd
      >>> from flax import nnx
      >>> layer, choice = jd.create_multihead_dilated_attention(
      ...     embed_dim=16, num_heads=2, segment_lengths=(8, 32), dilation_rates=(1, 2),
      ...     seq_len=32, explain=True, rngs=nnx.Rngs(0))
      >>> choice.kind, type(layer).__name__
      ('dilated', 'MultiheadDilatedAttention')
    """
    if kind in _RENAMED_KINDS:
        validation.warn_renamed(f"kind={kind!r}", f"kind={_RENAMED_KINDS[kind]!r}",
                                "create_multihead_dilated_attention")
        kind = _RENAMED_KINDS[kind]
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    classes = _layer_classes(api)
    if seq_len is not None:
        validation.check_positive_int("seq_len", seq_len)
    mesh, seq_axis = config.get("mesh"), config.get("seq_axis")
    validation.check_mesh_axes(mesh, seq_axis, config.get("batch_axis"),
                               config.get("head_axis"))
    if mesh is not None:  # "hybrid" for seq_axis=(a, b), else the layers' "ring"
        config["strategy"] = common.mesh_strategy(seq_axis, config.get("strategy"))
    if kind == "auto":
        choice = choose_kind(segment_lengths=config.get("segment_lengths"), mesh=mesh,
                             seq_axis=seq_axis, seq_len=seq_len,
                             pattern=config.get("pattern"))
        if choice.kind in ("dilated", "block_sparse"):  # chosen to stay on one device
            config = {k: v for k, v in config.items() if k not in _MESH_KEYS}
    else:
        choice = Choice(kind, "requested")
    if choice.kind in ("ring", "distributed", "block_sparse_ring") and mesh is None:
        raise ValueError(f"kind={choice.kind!r} shards the sequence over a mesh: pass "
                         f"mesh= and seq_axis=.")
    if choice.kind in ("dilated", "block_sparse") and config.get("mesh") is not None:
        parallel = "distributed" if choice.kind == "dilated" else "block_sparse_ring"
        raise ValueError(f"kind={choice.kind!r} runs on one device; with a mesh use "
                         f"kind={parallel!r} (or 'auto').")
    if choice.kind == "ring":
        given = [k for k in _DILATED_ONLY if k in config]
        if given:
            raise ValueError(
                f"kind='ring' is exact attention: {given} do not apply (use "
                f"kind='distributed' for dilated attention over a mesh).")
    layer = classes[choice.kind](**config)
    return (layer, choice) if explain else layer


def create_multihead_attention(kind: LayerKind = "auto", *, api: FlaxApi = "nnx",
                               seq_len: int | None = None, explain: bool = False,
                               **config) -> Layer | tuple[Layer, Choice]:
    """:func:`create_multihead_dilated_attention` under the name of what it builds:
    any multi-head layer (dilated, distributed dilated, ring, block-sparse).

    Example:
      >>> import jax, jax_dilated as jd
      >>> from flax import nnx
      >>> layer = jd.create_multihead_attention(
      ...     "ring", embed_dim=16, num_heads=2, mesh=jax.make_mesh((1,), ("seq",)),
      ...     seq_axis="seq", rngs=nnx.Rngs(0))
      >>> type(layer).__name__
      'MultiheadRingAttention'
    """
    return create_multihead_dilated_attention(kind, api=api, seq_len=seq_len,
                                              explain=explain, **config)
