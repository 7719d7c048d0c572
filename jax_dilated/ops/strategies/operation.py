"""The operation ``jd.sharded`` was given, and which strategies can serve it.

:func:`describe` reads the function given to ``jd.sharded`` (a library operation,
possibly under ``functools.partial``, or a custom function) into an :class:`Operation`;
:func:`servable` says which of the concrete strategies can run it on these shapes and
why the others cannot; :func:`require` turns that into the ``ValueError`` of a call whose
strategy cannot serve (for a per-branch tuple, branch by branch).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from jax_dilated.core import branch_plans
from jax_dilated.ops import block_sparse as block_sparse_ops
from jax_dilated.ops import dilated as dilated_ops
from jax_dilated.ops import distributed, head_parallel
from jax_dilated.ops.block_sparse_plan import ring_blocks
from jax_dilated.ops.dilated_programs import DilatedCall
from jax_dilated.ops.dilated_torchscale import MESH_REASON as TORCHSCALE_RING
from jax_dilated.ops.ring import ring_attention

__all__ = ["STRATEGIES", "Operation", "describe", "accepts", "check_sharded_strategy",
           "servable", "require", "plans_of", "torchscale"]

STRATEGIES = ("ring", "allgather", "heads", "hybrid", "auto")


@dataclasses.dataclass(frozen=True, eq=False)
class Operation:
    """What ``jd.sharded`` was given: which library operation and its bound options.

    kind: ``"exact"`` (:func:`jax_dilated.ring_attention`), ``"dilated"``,
      ``"block_sparse"``, or ``"custom"`` (any other function: only ``"ring"``, which
      passes it ``seq_axis``, and ``"heads"``, which calls it without, can run it).
    fn: the function as given; options: the keywords bound with ``functools.partial``.
    """

    kind: str
    fn: object
    options: dict

    @functools.cached_property
    def branches(self):
        """A dilated operation's branches, validated once
        (:func:`~jax_dilated.core.branch_plans.validate_branches`; its errors
        propagate)."""
        return branch_plans.validate_branches(self.options["segment_lengths"],
                                              self.options["dilation_rates"])

    @property
    def name(self) -> str:
        return {"exact": "ring_attention", "dilated": "dilated_attention",
                "block_sparse": "block_sparse_attention"}.get(self.kind, "a custom function")


def describe(fn) -> Operation:
    """The :class:`Operation` of ``fn`` (a library operation, possibly under
    ``functools.partial`` with keywords only, or anything else: ``"custom"``)."""
    base, options = fn, {}
    while isinstance(base, functools.partial) and not base.args:
        options = {**base.keywords, **options}
        base = base.func
    kinds = {ring_attention: "exact", dilated_ops.dilated_attention: "dilated",
             block_sparse_ops.block_sparse_attention: "block_sparse"}
    kind = kinds.get(base, "custom")
    return Operation(kind, fn, options if kind != "custom" else {})


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (True when its signature cannot be read:
    the call then decides)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def servable(op: Operation, *, num_heads: int, num_devices: int, layout: str,
             seq_len: int | None = None, heads_of: str = "",
             segment_ids: bool = False) -> dict:
    """``{strategy: None or why it cannot serve}`` for the concrete strategies.

    With ``seq_len`` the operation's own sharding rules are checked too (dilated
    segments that would straddle devices, block-sparse blocks that would straddle
    shards), so that ``"auto"`` never picks a strategy that would then refuse.
    ``heads_of`` says whose heads ``num_heads`` counts in messages (e.g. those of one
    ``head_axis`` shard). ``segment_ids``: the call has packed rows; a custom function
    must then take ``segment_ids=``, and packed dilated attention has no segment rule
    to check (it runs whole sequences of some heads, :func:`.over_heads`).
    """
    why = {"ring": None, "allgather": None, "heads": None}
    why["heads"] = head_parallel.heads_unservable(num_heads, num_devices, heads_of)
    # torchscale's dilated attention runs whole sequences of some heads, as packed rows do
    whole = segment_ids or torchscale(op)
    if torchscale(op):
        why["ring"] = TORCHSCALE_RING
    if (why["heads"] and op.kind == "dilated" and not whole and seq_len is not None
            and layout == "contiguous"
            and _dilated_heads_by_branch(op, seq_len, num_heads, num_devices)):
        why["heads"] = None  # it runs branch by branch (distributed.heads_by_branch)
    if op.kind == "custom":
        why["allgather"] = ("strategy='allgather' needs one of the library's operations "
                            "(ring_attention, dilated_attention, block_sparse_attention), "
                            f"got {_fn_name(op.fn)}")
        if segment_ids and not accepts(op.fn, "segment_ids"):
            for s in ("ring", "heads"):
                why[s] = why[s] or (f"segment_ids needs a function that takes "
                                    f"segment_ids=, and {_fn_name(op.fn)} does not")
    sequence = None
    if op.kind == "dilated" and layout != "contiguous":
        sequence = f"dilated attention shards the sequence contiguously, got layout={layout!r}"
    elif op.kind == "block_sparse" and layout == "striped":
        sequence = ("block-sparse attention needs shards made of whole blocks, got "
                    "layout='striped'")
    elif seq_len is not None and op.kind == "dilated" and whole:
        pass  # packed rows, torchscale: every strategy runs whole sequences (over_heads)
    elif seq_len is not None and op.kind in ("dilated", "block_sparse"):
        try:
            n = seq_len // num_devices
            if op.kind == "dilated":
                distributed.shard_branches(op.branches, local_len=n, num_devices=num_devices)
            else:
                ring_blocks(n, num_devices, layout, op.options["block_size"])
        except (ValueError, TypeError, KeyError) as err:
            sequence = str(err).rstrip(".")
    if sequence:
        why["ring"] = why["allgather"] = sequence
    unsupported = _ring_only_options(op)
    if unsupported:
        for s in ("allgather", "heads"):
            why[s] = why[s] or (f"strategy={s!r} does not carry {unsupported} yet (only "
                                "the operation's own ring does)")
    if op.options.get("return_lse") and op.kind != "dilated":
        # dilated attention returns its lse under every strategy (strategy=)
        for s in ("allgather", "heads"):
            why[s] = why[s] or (f"strategy={s!r} returns the output only, not the "
                                "log-sum-exp of return_lse=True (the operation's own "
                                "ring does)")
    return why


def torchscale(op: Operation) -> bool:
    """Whether ``op`` is dilated attention in ``mode="torchscale"``."""
    return op.kind == "dilated" and op.options.get("mode") == "torchscale"


def dilated_call(op: Operation) -> DilatedCall:
    """A dilated ``op``'s call as far as its plans go (branches, mode, head offsets;
    no kernel or kernel arguments: the cost model reads the plans only)."""
    return DilatedCall(op.branches, op.options.get("mode", "longnet"),
                       op.options.get("head_offsets", "modulo"), None, None, None)


def plans_of(op: Operation, *, seq_len: int, num_heads: int, num_kv_heads: int):
    """``(branches, plans)`` of a dilated ``op`` for these shapes (its own validation
    errors propagate)."""
    return op.branches, dilated_call(op).plans(seq_len=seq_len, num_heads=num_heads,
                                               num_kv_heads=num_kv_heads)


def _dilated_heads_by_branch(op: Operation, seq_len: int, num_heads: int,
                            num_devices: int) -> bool:
    """Whether dilated attention's ``"heads"`` runs branch by branch
    (:func:`jax_dilated.ops.distributed.heads_by_branch`; its query heads decide)."""
    try:
        branches, plans = plans_of(op, seq_len=seq_len, num_heads=num_heads,
                                    num_kv_heads=num_heads)
    except (ValueError, TypeError, KeyError):
        return False
    return distributed.heads_by_branch(branches, plans, local_len=seq_len // num_devices,
                                       num_devices=num_devices) is not None


def _ring_only_options(op: Operation) -> str:
    """The options of ``op`` that only its own ring applies (the other strategies
    rebuild the call from plain options and would drop them), as ``"a=, b="``.
    Dilated attention runs every strategy itself (``strategy=`` of
    :func:`jax_dilated.dilated_attention`), so it carries all of its options."""
    if op.kind == "dilated":
        return ""
    names = [name for name in ("window", "logit_soft_cap", "sinks")
             if op.options.get(name) is not None]
    return ", ".join(f"{n}=" for n in names)


def _fn_name(fn) -> str:
    inner = getattr(fn, "func", fn)
    return getattr(inner, "__name__", repr(inner))


def check_sharded_strategy(strategy):
    """The ``strategy=`` of ``jd.sharded`` and the mesh-built layers, as given: one of
    :data:`STRATEGIES`, or (dilated attention) a tuple of ``"ring"``, ``"allgather"``,
    ``"heads"``, one per branch (its length is checked against the branches at the
    call: :func:`jax_dilated.ops.distributed.check_branch_strategy`)."""
    if isinstance(strategy, str) and strategy in STRATEGIES:
        return strategy
    if (isinstance(strategy, (tuple, list)) and strategy
            and all(isinstance(e, str) and e in distributed.BRANCH_STRATEGIES
                    for e in strategy)):
        return tuple(strategy)
    raise ValueError(f"strategy must be one of {STRATEGIES}, or for dilated attention a "
                     f"tuple with one of {distributed.BRANCH_STRATEGIES} per branch, got "
                     f"{strategy!r}.")


def require(op: Operation, strategy, *, num_heads: int, num_devices: int,
            layout: str, seq_len: int | None = None, heads_of: str = "",
            segment_ids: bool = False, num_kv_heads: int | None = None) -> None:
    """Raise ``ValueError`` naming the strategies that can serve when ``strategy``
    cannot. (``"ring"`` without segment ids is left to the operation, whose own
    messages say why.)"""
    if isinstance(strategy, tuple):
        return _require_per_branch(op, strategy, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads or num_heads,
                                   num_devices=num_devices, layout=layout,
                                   seq_len=seq_len, segment_ids=segment_ids)
    if strategy == "ring" and not segment_ids:
        return
    why = servable(op, num_heads=num_heads, num_devices=num_devices, layout=layout,
                   seq_len=seq_len, heads_of=heads_of, segment_ids=segment_ids)
    if why.get(strategy) is None:
        return
    others = [s for s, w in why.items() if w is None]
    alt = (f"use strategy={others[0]!r}" + "".join(f" or {s!r}" for s in others[1:])
           if others else "no strategy can serve this call")
    raise ValueError(f"{why[strategy]}; {alt} (strategy='auto' chooses among those).")


def _require_per_branch(op, strategy, *, num_heads, num_kv_heads, num_devices, layout,
                        seq_len, segment_ids):
    """A per-branch strategy: dilated attention only, one entry per branch, each able
    to serve its branch (:func:`jax_dilated.ops.distributed.branch_strategies`)."""
    if op.kind != "dilated":
        raise ValueError(f"a per-branch strategy {strategy!r} needs dilated_attention, got "
                         f"{op.name}; use one of {STRATEGIES}.")
    branches = op.branches
    distributed.check_branch_strategy(strategy, len(branches))
    if torchscale(op):
        raise ValueError(f"a per-branch strategy {strategy!r}: {TORCHSCALE_RING}.")
    if segment_ids or seq_len is None:
        return  # packed rows run whole sequences of some heads under every strategy
    if layout != "contiguous":
        raise ValueError(f"dilated attention shards the sequence contiguously, got "
                         f"layout={layout!r}.")
    _, plans = plans_of(op, seq_len=seq_len, num_heads=num_heads,
                        num_kv_heads=num_kv_heads)
    sbs = distributed.shard_branches(branches, local_len=seq_len // num_devices,
                                     num_devices=num_devices)
    distributed.branch_strategies(strategy, plans, sbs)
