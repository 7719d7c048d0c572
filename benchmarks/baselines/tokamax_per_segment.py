"""``tokamax.dot_product_attention(implementation="xla")`` per dilated segment.

tokamax is the JAX kernel library a user would try for fast attention; on CPU its
portable implementation is ``"xla"``. The dilated segments are gathered and
scattered exactly as in ``benchmarks/baselines/jax_per_segment.py`` (the same
:func:`~benchmarks.baselines.jax_per_segment.per_segment_attention`), so the two
JAX peers differ only in the attention function.

head_groups only: tokamax's public ``dot_product_attention`` returns the output but
not the log-sum-exp that ``mode="longnet"`` needs to mix its branches.
Install: ``bash benchmarks/setup.sh`` (the ``peers`` extra of pyproject.toml).
"""

from __future__ import annotations

import sys

from benchmarks.baselines import jax_per_segment

NAME = "tokamax"
INSTALL = "bash benchmarks/setup.sh"
MODES = ("head_groups",)
LONGNET_UNSUPPORTED = ("tokamax.dot_product_attention returns no log-sum-exp, which "
                       "longnet needs to mix its branches")

__all__ = ["INSTALL", "MODES", "NAME", "available", "dilated_attention"]


def _tokamax():
    """Import tokamax with its absl flags at their defaults.

    tokamax reads its configuration from absl flags and, when nobody has parsed
    them, parses ``sys.argv``, which fails on the benchmark's own options
    ("Unknown command line flag"); parsing the program name alone keeps the
    defaults."""
    import tokamax
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
    return tokamax


def available() -> str | None:
    """None if tokamax imports, else why not."""
    try:
        _tokamax()
    except ImportError as err:
        return f"peer {NAME} not installed ({err}): {INSTALL}"
    return None


def tokamax_attention(q, k, v, *, is_causal: bool, scale: float, return_lse: bool):
    """``tokamax.dot_product_attention(implementation="xla")`` as a per-segment attention."""
    if return_lse:
        raise NotImplementedError(LONGNET_UNSUPPORTED)
    return _tokamax().dot_product_attention(q, k, v, scale=scale, is_causal=is_causal,
                                         implementation="xla"), None


def dilated_attention(query, key, value, *, segment_lengths, dilation_rates,
                      mode: str = "head_groups", is_causal: bool = False,
                      scale: float | None = None):
    """head_groups dilated attention with tokamax per dilated segment ([B, n, H, D])."""
    if mode not in MODES:
        raise NotImplementedError(f"mode={mode!r}: {LONGNET_UNSUPPORTED}")
    return jax_per_segment.per_segment_attention(
        query, key, value, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
        mode=mode, is_causal=is_causal, scale=scale, attention=tokamax_attention)
