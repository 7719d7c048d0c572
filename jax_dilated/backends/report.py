"""``jd.backend_report()``: which kernel every operation would use on this machine, and why."""

from __future__ import annotations

import sys
from typing import NamedTuple, TextIO

import jax

from jax_dilated.backends import native, registry, selection
from jax_dilated.backends.native import gemm
from jax_dilated.core import validation
from jax_dilated.core.types import DTypeLike

__all__ = ["KernelChoice", "backend_report"]


class KernelChoice(NamedTuple):
    """One line of :func:`backend_report`."""

    operation: str
    kernel: str
    reason: str

    def __str__(self):
        return f"{self.operation}: {self.kernel} - {self.reason}"


def _rows(info, dtype: str, head_dim: int, software_reason) -> list[KernelChoice]:
    spec = selection.CallSpec

    def row(operation, call, *, lse_cotangent=False, note="", ring=False, native_note=""):
        kernel, why = registry.explain_call(info, call, software_reason=software_reason,
                                            lse_cotangent=lse_cotangent)
        if ring and kernel == "native":  # a ring runs the XLA kernel's fused steps
            kernel, why = "xla", "the XLA kernel's ring steps (the native kernel has none)"
        note = {"cudnn": note, "native": native_note}.get(kernel, "")
        return KernelChoice(operation, kernel, why + (f"; {note}" if note else ""))

    dense = spec(dtype, head_dim)
    causal = spec(dtype, head_dim, is_causal=True)
    ring_causal = spec(dtype, head_dim, is_causal=True, positions="arbitrary")
    tails = ("calls with a kv_mask, dropout, or the short last segment of a branch "
             "whose segment length does not divide the sequence use the XLA kernel")
    global_rows = ("the backward runs from the global lse and output (a loss on the "
                   "returned lse too: the head widened by 8 columns to carry delta - dlse)")
    return [
        row("dilated_attention mode='longnet'", causal,
            note=f"branches streamed into the merged output; {global_rows}; {tails}"),
        row("dilated_attention mode='head_groups'", causal, note=tails),
        row("ring_attention is_causal=False", dense,
            note=f"every ring step: {global_rows}", ring=True),
        row("ring_attention is_causal=True", ring_causal, ring=True),
        row("dilated_attention(seq_axis=...) local branches", causal, lse_cotangent=True,
            note="as single-device longnet"),
        row("dilated_attention(seq_axis=...) branches spanning devices", ring_causal,
            ring=True),
        row("block_sparse_attention", spec(dtype, head_dim, block_sparse=True)),
        row("dilated_attention_decode (KV cache)",
            spec(dtype, head_dim, len_q=1, kv_valid=True)),
        # issue 18 (docs/semantics.md, "Sliding windows, soft-capping and sinks")
        row("ring_attention / block_sparse_attention window=(left, right)",
            spec(dtype, head_dim, is_causal=True, positions="arbitrary", window=True)),
        row("dilated_attention jd.SlidingWindow branch",
            spec(dtype, head_dim, is_causal=True, window=True),
            note="cuDNN's causal mask with sliding_window_length = left + 1; a "
                 "non-causal window reaching right of the query uses the XLA kernel"),
        row("logit_soft_cap=c (every operation)",
            spec(dtype, head_dim, is_causal=True, soft_cap=True)),
        row("sinks= (every operation)", causal,
            note="the sinks are folded into the kernel call's output and lse (a ring's "
                 "accumulators start from them); the operation's own rules above say "
                 "whether its backward also takes an lse cotangent"),
        # issue 49 (docs/semantics.md, 'mode="torchscale"')
        row("dilated_attention mode='torchscale'", dense,
            note="each branch on its zero-padded copy (cuDNN serves whole segments only)",
            native_note="not differentiated and no branch shifting its outputs, every "
                        "branch in one call; differentiated, branch by branch"),
    ]


def backend_report(device: jax.Device | selection.DeviceInfo | None = None, *,
                   dtype: DTypeLike = "bfloat16", head_dim: int = 128,
                   file: TextIO | None = None, quiet: bool = False,
                   software_reason: str | None = "detect") -> list[KernelChoice]:
    """Which kernel each operation would use on ``device`` with ``implementation=None``.

    Args:
      device: a ``jax.Device`` (default ``jax.devices()[0]``) or a described device
        (anything with ``platform``, ``device_kind``, ``compute_capability``).
      dtype, head_dim: the inputs to report for (default bfloat16, 128).
      file: a text file to print the report to; None (default): ``sys.stdout``.
        (The string ``"stdout"`` is a deprecated spelling of None.)
      quiet: do not print, only return the rows.
      software_reason: ``"detect"`` checks the installed JAX for cuDNN; pass None
        (present) or a reason to describe another machine.

    Returns:
      one :class:`KernelChoice` (operation, kernel, reason) per operation.

    Example:
      >>> import jax_dilated as jd
      >>> rows = jd.backend_report(quiet=True)     # jd.backend_report() prints it
      >>> rows[0].operation, rows[0].kernel in ("xla", "cudnn", "native")
      ("dilated_attention mode='longnet'", True)
    """
    device = jax.devices()[0] if device is None else device
    info = selection.describe_device(device)
    dtype = jax.numpy.dtype(dtype).name
    rows = _rows(info, dtype, head_dim, software_reason)
    if isinstance(file, str) and file == "stdout":
        validation.warn_renamed('file="stdout"', "file=None", "backend_report")
        file = None
    if not quiet:
        file = sys.stdout if file is None else file
        available = selection.cudnn_device_reason(info, software_reason)
        print(f"jax-dilated kernels on {info} with JAX {jax.__version__}; inputs {dtype}, "
              f"head_dim {head_dim}", file=file)
        print("cuDNN fused attention: " + ("available" if available is None
                                           else f"not used ({available})"), file=file)
        if info.platform == "cpu":
            why = registry.native_reason(info)
            print("native CPU kernel: " + (
                f"available ({native.instruction_set()} build; float32, bfloat16 and "
                f"float16 inputs)" if why is None else f"not used ({why})"), file=file)
            dense = gemm.unavailable_reason()
            print("dense products of the layers and models (one device): " + (
                gemm.library_name() if dense is None else f"XLA's dot ({dense})"), file=file)
        width = max(len(r.operation) for r in rows)
        for r in rows:
            print(f"  {r.operation:<{width}}  {r.kernel:<6}  {r.reason}", file=file)
        print("implementation='xla' forces the XLA kernel; implementation='cudnn' (or "
              "'native') forces that kernel where it serves a call, or raises ValueError "
              "saying why it cannot run here.", file=file)
        print("Over a mesh, jd.sharded(..., strategy=) runs the sequence axis as a 'ring' "
              "(default), 'allgather', 'heads' (all-to-all) or 'auto'; "
              "jd.explain_strategy(fn, query_shape, key_shape, num_devices=P) prints "
              "what 'auto' picks and why.", file=file)
    return rows
