"""Which code runs a call: the one-device program each dilated call takes, and how many
of the library's own frames lie between an operation's entry point and its kernel.

The frame counts are the library functions on the stack when the kernel method is
entered (the operation's entry point included, the kernel method not), recorded while
the call is traced. A kernel method is a kernel's computation: its ``forward``,
``attention``, ``block_sparse_forward`` or fused ``dilated_forward``, one step of its
ring steps (``forward``), or a head exchange around a kernel (``HeadExchange``, itself
a kernel). On a mesh, ``jd.sharded``'s own frames (the checks, the compiled program
and the ``shard_map`` body that calls the operation) are counted apart.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh

import jax_dilated as jd
from jax_dilated.backends import native, xla
from jax_dilated.backends.xla import ring as xla_ring
from jax_dilated.ops import branch_groups, dilated_programs

ROOT = pathlib.Path(jd.__file__).parent
CFG = dict(segment_lengths=(64, 128), dilation_rates=(1, 2))


def _library_frames(depth: int) -> list[str]:
    """``module:function`` of every library frame below the caller's caller."""
    frame, out = sys._getframe(depth), []
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT):
            out.append(f"{path.relative_to(ROOT).with_suffix('')}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every kernel method entered while a call is traced: ``[(method, frames)]``."""
    seen = []

    def record(cls, name):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self, *args, **kw):
            seen.append((f"{cls.__name__}.{name}", _library_frames(2)))
            return original(self, *args, **kw)

        monkeypatch.setattr(cls, name, wrapper)

    for name in ("forward", "attention", "block_sparse_forward"):
        record(xla.XlaKernel, name)
    for name in ("forward", "attention", "dilated_forward"):
        record(native.NativeCpuKernel, name)
    record(xla_ring._RingSteps, "forward")
    record(branch_groups.HeadExchange, "forward")
    return seen


def _inputs(t=256, h=4, d=16):
    x = jax.random.normal(jax.random.key(0), (1, t, h, d), jnp.float32)
    return x, x * 0.5, x * 0.25


def _call_of(seen, method, fn, *args):
    """The library frames below the first call of ``method`` while ``fn`` is traced."""
    seen.clear()
    jax.jit(fn).lower(*args)
    frames = [f for m, f in seen if m == method]
    assert frames, f"{method} was not entered; entered: {[m for m, _ in seen]}"
    return frames[0]


def _sharded(fn, strategy="ring", axes=("seq",), shape=(4,), seq_axis="seq"):
    """``jd.sharded(fn, ...)`` on a mesh built when the call is made, inside the test:
    PATHS is built at import, and a mesh the machine lacks (one GPU) skips the test
    that needs it, not the module."""
    def call(*args, **kw):
        return jd.sharded(fn, build_mesh(shape, axes, "auto"), seq_axis=seq_axis,
                          strategy=strategy)(*args, **kw)

    return call


_DILATED_XLA = functools.partial(jd.dilated_attention, implementation="xla", **CFG)
_PACKED_IDS = jnp.repeat(jnp.arange(2), 128)[None]
_PATTERN = np.tril(np.ones((4, 4), bool))
_BLOCK_SPARSE = functools.partial(jd.block_sparse_attention, block_size=64, pattern=_PATTERN)

# (path, the call, the kernel method it reaches); the operation's frames are at most 5
PATHS = [
    ("dilated, fused (native)", lambda q, k, v: jd.dilated_attention(q, k, v, **CFG),
     "NativeCpuKernel.dilated_forward"),
    ("dilated, streamed (xla)", _DILATED_XLA, "XlaKernel.forward"),
    ("dilated, packed rows (xla)",
     lambda q, k, v: _DILATED_XLA(q, k, v, segment_ids=_PACKED_IDS), "XlaKernel.forward"),
    ("dilated, decoding (xla)",
     lambda q, k, v: jd.dilated_attention_decode(q[:, :1], k, v, 200, implementation="xla",
                                                 **CFG), "XlaKernel.forward"),
    ("block-sparse, one device", _BLOCK_SPARSE, "XlaKernel.block_sparse_forward"),
    ("dilated, mesh, ring", _sharded(_DILATED_XLA), "XlaKernel.forward"),
    ("dilated, mesh, heads by branch", _sharded(_DILATED_XLA, "heads"),
     "HeadExchange.forward"),
    # a sliding-window branch: "heads" runs as one all-to-all of the whole call
    ("dilated, mesh, heads", _sharded(functools.partial(
        jd.dilated_attention, implementation="xla",
        segment_lengths=(64, jd.SlidingWindow(32, 32)), dilation_rates=(1, 1)), "heads"),
     "XlaKernel.forward"),
    ("dilated, mesh, allgather", _sharded(_DILATED_XLA, "allgather"), "XlaKernel.forward"),
    ("dilated, mesh, packed rows",
     lambda q, k, v: _sharded(_DILATED_XLA)(q, k, v, segment_ids=_PACKED_IDS),
     "XlaKernel.forward"),
    ("dilated, mesh, hybrid", _sharded(_DILATED_XLA, "hybrid", ("a", "b"), (2, 2),
                                       ("a", "b")), "XlaKernel.forward"),
    ("exact, mesh, ring", _sharded(functools.partial(jd.ring_attention, implementation="xla")),
     "_RingSteps.forward"),
    ("block-sparse, mesh, ring", _sharded(functools.partial(_BLOCK_SPARSE,
                                                            implementation="xla")),
     "_RingSteps.forward"),
]


@pytest.mark.parametrize("name,fn,method", PATHS, ids=[c[0] for c in PATHS])
def test_frames_to_the_kernel(kernel_calls, name, fn, method):
    if "native" in name and native.unavailable_reason():
        # the fused path is the native kernel's: without a C++ compiler, on a CPU
        # without AVX2, or off Linux the XLA kernel serves and the path does not exist
        pytest.skip(native.unavailable_reason())
    frames = _call_of(kernel_calls, method, fn, *_inputs())
    wrapper = [f for f in frames if f.startswith("ops/sharded:")]
    assert len(wrapper) <= 3, f"{name}: jd.sharded's frames " + " -> ".join(wrapper)
    own = frames[len(wrapper):]
    assert len(own) <= 5, f"{name}: {len(own)} frames: " + " -> ".join(own)


@pytest.mark.parametrize("implementation,program", [("xla", "streamed"), (None, "fused")])
def test_one_dispatcher_chooses_the_program(implementation, program):
    """The program the dispatcher names is the one that runs (the fused one only where
    the native kernel builds), and the reason is given in words."""
    if program == "fused" and native.unavailable_reason():
        # as above: only the native kernel has a fused program
        pytest.skip(native.unavailable_reason())
    q, k, v = _inputs()
    kernel = jd.backends.get_kernel(implementation)
    call = dilated_programs.DilatedCall(
        branches=((64, 1), (128, 2)), mode="longnet", head_offsets="modulo",
        args=jd.backends.KernelArgs(scale=0.25), kernel=kernel, max_documents=None)
    plans = call.plans(seq_len=256, num_heads=4, num_kv_heads=4)
    got, why = dilated_programs.choose_program(kernel, call.args, plans, "longnet", q, k,
                                               None, None)
    assert got == program and why
    # dropout never runs fused: its masks are drawn chunk by chunk
    got, why = dilated_programs.choose_program(kernel, call.args, plans, "longnet", q, k,
                                               None, jax.random.key(0))
    assert got == "streamed" and (program != "fused" or "dropout" in why), why
