"""The PyPI ``dilated-attention-pytorch`` library's ``DilatedAttention`` on CPU (timed only).

``dilated-attention-pytorch`` 0.2.0 is the public pure-PyTorch LongNet code ("head
groups": head group ``i`` runs branch ``i`` at offset ``i mod r``). It calls
``xformers.ops.memory_efficient_attention``, and xformers has no CPU build here, so
before importing it this module installs a small shim as ``xformers`` /
``xformers.ops`` that maps ``memory_efficient_attention(query, key, value, op=None,
attn_bias=None)`` (layout ``[B, L, H, D]``) to torch's
``scaled_dot_product_attention`` (layout ``[B, H, L, D]``, its CPU flash kernel),
causal when ``attn_bias`` is a ``LowerTriangularMask``. An xformers that is really
installed is used as it is.

Its numbers are not LongNet's (docs/semantics.md, section 2), so the benchmark times
it but does not compare its output with ours:

* each branch's output is divided by its sum over the segments and positions,
  ``x / x.sum(dim=(1, 2))``, before the branches are added;
* head group ``i`` is heads ``i * g .. (i + 1) * g`` with ``g`` its own size, which is
  right only when all groups have the same size (8 heads, 3 branches: sizes 3, 3, 2,
  and the third group reads heads 4-5 instead of 6-7).

The work is the same as head_groups dilated attention's (the same dilated segments
through the same SDPA kernel), which is what the timing compares. Install:
``bash benchmarks/setup.sh`` (``pip install --no-deps dilated-attention-pytorch==0.2.0``:
its declared dependencies pin xformers and torchscale, which pull a CUDA torch).
"""

from __future__ import annotations

import sys
import types

INSTALL = "bash benchmarks/setup.sh"
NAME = "dilated-attention-pytorch"

__all__ = ["INSTALL", "NAME", "available", "install_xformers_shim", "load"]


def install_xformers_shim() -> None:
    """Put a CPU ``xformers.ops`` (torch SDPA) in ``sys.modules`` unless xformers imports."""
    try:
        import xformers.ops  # noqa: F401
        return
    except ImportError:
        pass
    import torch
    import torch.nn.functional as F

    class LowerTriangularMask:
        """Marker of causal attention, as xformers' own."""

    class AttentionOp:
        """Placeholder type (the library annotates its ``op`` argument with it)."""

    def memory_efficient_attention(query, key, value, attn_bias=None, p: float = 0.0,
                                   scale=None, *, op=None):
        """xformers' signature on ``[B, L, H, D]``; torch SDPA (CPU flash) inside."""
        if attn_bias is not None and not isinstance(attn_bias, LowerTriangularMask):
            raise NotImplementedError("the CPU shim supports attn_bias None or "
                                      "LowerTriangularMask only")
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, scale=scale,
            is_causal=isinstance(attn_bias, LowerTriangularMask))
        return out.transpose(1, 2)

    ops = types.ModuleType("xformers.ops")
    ops.memory_efficient_attention = memory_efficient_attention
    ops.LowerTriangularMask = LowerTriangularMask
    ops.AttentionOp = AttentionOp
    ops.__doc__ = "CPU shim of xformers.ops (benchmarks/baselines/dilated_attention_pytorch.py)"
    root = types.ModuleType("xformers")
    root.ops = ops
    root.__path__ = []  # a package, so `import xformers.ops` resolves to the shim
    sys.modules.setdefault("xformers", root)
    sys.modules.setdefault("xformers.ops", ops)
    del torch


def available() -> str | None:
    """None if the library can be loaded, else why not."""
    try:
        load()
    except ImportError as err:
        return f"peer {NAME} not installed ({err}): {INSTALL}"
    return None


def load():
    """The library's ``DilatedAttention`` class (after installing the shim)."""
    install_xformers_shim()
    from dilated_attention_pytorch.dilated_attention import DilatedAttention
    return DilatedAttention


def dilated_attention(query, key, value, *, segment_lengths, dilation_rates,
                      is_causal: bool = False):
    """``DilatedAttention(segment_lengths, dilation_rates)(query, key, value, is_causal)``
    on ``[batch, seq, heads, head_dim]`` torch tensors (see the module docstring for how
    its result differs from LongNet's)."""
    module = load()(segment_lengths=list(segment_lengths), dilation_rates=list(dilation_rates))
    return module(query, key, value, is_causal=is_causal)
