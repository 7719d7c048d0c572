"""PyTorch references for the parity suite, written from the mathematics of docs/semantics.md.

These are deliberately plain (dense masks, Python loops over branches, heads and
segments) and share no code with ``jax_dilated``: they are an independent
statement of the mathematics, differentiable with ``torch.autograd`` so they
also give the reference gradients.

* :func:`dense_attention` - exact masked softmax attention, [B, T, H, D] layout.
* :func:`longnet_dilated_attention` - mode="longnet", per-branch/segment/head loops
  merged by the branch softmax denominators (LongNet Eq. 10).
* :func:`longnet_dense_form` - the same function written as one dense attention
  with logits ``scale*q.k + log m(p, t)``.
* :func:`head_groups_dilated_attention` - mode="head_groups".
"""

from torch_reference.dense import dense_attention
from torch_reference.dilated import (
    branch_attention,
    head_groups_dilated_attention,
    head_offsets,
    longnet_dense_form,
    longnet_dilated_attention,
    merge_branches,
    segments,
)

__all__ = [
    "dense_attention",
    "branch_attention",
    "head_groups_dilated_attention",
    "head_offsets",
    "longnet_dense_form",
    "longnet_dilated_attention",
    "merge_branches",
    "segments",
]
from torch_reference.multihead import MultiheadDilatedAttention  # noqa: E402

__all__ += ["MultiheadDilatedAttention"]
from torch_reference.block_sparse import block_sparse_attention, expand_block_mask  # noqa: E402

__all__ += ["block_sparse_attention", "expand_block_mask"]
