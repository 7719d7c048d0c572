"""The types of the public signatures: the string options as ``Literal`` aliases, and
the array types.

Array inputs are annotated :data:`ArrayLike` (``jax.typing.ArrayLike``: a
``jax.Array`` or a NumPy array; the operations check rank and dtype at trace time),
results :data:`Array` (``jax.Array``), as JAX annotates its own functions. The option
aliases list exactly the values the checks accept (the tuples the checks use, such as
:data:`jax_dilated.core.branch_plans.MODES`, are read from them; tests/test_public_api.py
holds the others equal). A user's code passes plain strings; a type checker then
flags a misspelt option at the call. Code that forwards an option may import the
aliases from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Union

import jax
from jax.typing import ArrayLike, DTypeLike

from jax_dilated.core.branches import SlidingWindow

__all__ = ["Array", "ArrayLike", "DTypeLike", "Mode", "HeadOffsets", "Layout",
           "Strategy", "BranchStrategy", "DilatedStrategy", "StrategyLike", "Implementation", "LayerKind",
           "FlaxApi", "SegmentLengths"]

Array = jax.Array

# how the branches of dilated attention share the heads (docs/semantics.md, section 2)
Mode = Literal["longnet", "head_groups", "torchscale"]
# longnet's offset rule: head j takes offset j mod r, or floor(j / ceil(H / r))
HeadOffsets = Literal["modulo", "blocked"]
# how a sequence sharded over P devices is laid out (ring attention)
Layout = Literal["contiguous", "zigzag", "striped"]
# how a sequence-parallel call runs over the mesh axis (jd.sharded, the mesh layers);
# "auto" picks one per call (jd.explain_strategy)
Strategy = Literal["ring", "allgather", "heads", "hybrid", "auto"]
# what one branch of dilated attention that spans devices does (an entry of a
# per-branch strategy tuple; also jd.dilated_attention's strategy=)
BranchStrategy = Literal["ring", "allgather", "heads"]
# jd.dilated_attention's own strategy= over a mesh: one for every branch, or "hybrid"
# with two mesh axes (a per-branch tuple is a sequence of BranchStrategy)
DilatedStrategy = Literal["ring", "allgather", "heads", "hybrid"]
# strategy= of jd.sharded and the mesh-built layers: one strategy for the call, or (dilated
# attention) one entry per branch
StrategyLike = Union[Strategy, Sequence[BranchStrategy]]
# a kernel by name; None (not part of the alias) chooses by device kind
Implementation = Literal["xla", "cudnn", "native"]
# the layer jd.create_multihead_dilated_attention builds ("auto": chosen, with a reason)
LayerKind = Literal["auto", "dilated", "ring", "distributed", "block_sparse",
                    "block_sparse_ring"]
# which Flax API the factory builds for
FlaxApi = Literal["nnx", "linen"]
# segment lengths of the branches: an int, or a sliding-window branch
SegmentLengths = Sequence[Union[int, SlidingWindow]]
