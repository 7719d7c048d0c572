"""The ``ringattention`` package (PyPI) inside ``jax.shard_map``: the ``ring`` op's peer.

``ringattention`` (the blockwise JAX ring attention of Liu et al.) is an optional
peer, installed by ``bash benchmarks/setup.sh`` (the ``peers`` extra); it is never a
dependency of jax-dilated. :func:`load` imports it lazily and says why when it
cannot; :func:`ring_fn` wraps its ``ringattention_jax`` for a ``("seq",)`` mesh so
that it takes the same global ``[batch, n, heads, head_dim]`` arrays as
``jd.sharded(jd.ring_attention, ...)``.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

NAME = "ringattention (PyPI)"
INSTALL = "bash benchmarks/setup.sh"


def load() -> tuple[ModuleType | None, str]:
    """``(module, status)``; ``(None, why)`` when it is missing or fails to import.

    ringattention 0.1.2 reads ``jax.lib.xla_bridge.get_backend()`` at import time,
    an alias that current JAX has removed; the same function lives in
    ``jax.extend.backend``. The alias is put back for the import only (the shim
    lives here, in the benchmark, never in the library).
    """
    import jax
    shimmed = False
    if not hasattr(jax.lib, "xla_bridge"):
        import jax.extend.backend
        jax.lib.xla_bridge = SimpleNamespace(get_backend=jax.extend.backend.get_backend)
        shimmed = True
    try:
        import ringattention
    except ImportError as err:
        return None, f"peer ringattention not installed ({err}): {INSTALL}"
    except Exception as err:  # noqa: BLE001 - another incompatibility with this JAX
        return None, f"import failed on jax {jax.__version__}: {type(err).__name__}: {err}"
    finally:
        if shimmed:
            del jax.lib.xla_bridge
    return ringattention, ("imported with a jax.lib.xla_bridge shim" if shimmed else "imported")


def version() -> str | None:
    """The installed distribution's version, or None."""
    import importlib.metadata
    try:
        return importlib.metadata.version("ringattention")
    except importlib.metadata.PackageNotFoundError:
        return None


def ring_fn(module: ModuleType, mesh, *, causal: bool, chunk: int, dtype):
    """``f(q, k, v) -> out`` on global ``[B, n, H, D]`` arrays sharded over ``mesh``'s
    ``"seq"`` axis (contiguous layout), running ``module.ringattention_jax`` per shard.

    Its signature: ``ring_attention(q, k, v, attn_bias, segment_ids, cache_idx,
    axis_name, float32_logits, blockwise_kwargs)`` on the local shards of a
    contiguous sequence; causality is the ``causal_block_size`` kwarg (1 = per
    token); scale ``1/sqrt(head_dim)``, the same as jax-dilated's default.
    ``chunk`` is its query and key chunk size.
    """
    import jax
    from jax.sharding import PartitionSpec as P
    kwargs = dict(causal_block_size=1 if causal else None, query_chunk_size=chunk,
                  key_chunk_size=chunk, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                  dtype=dtype, policy=jax.checkpoint_policies.nothing_saveable,
                  precision=None, prevent_cse=False)

    def local(q, k, v):
        return module.ringattention_jax(q, k, v, None, None, None, "seq", True, kwargs)

    spec = P(None, "seq")
    # its carries are not varying-typed, so shard_map's vma check is off for it
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)
