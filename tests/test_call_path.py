"""Which code runs a call: the one-device program each dilated call takes, and how many
of the library's own frames lie between an operation's entry point and its kernel.

The frame counts are the library functions on the stack when the kernel method is
entered (the entry point included, the kernel method not), recorded while the call
is traced. Each bound is the count of the path as it is: a path that grows a frame
fails here, and the issue that shrinks one lowers its bound.
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
from jax_dilated.ops import dilated_programs

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

    for name in ("forward", "attention", "block_sparse_forward", "ring_steps",
                 "block_sparse_ring_steps"):
        record(xla.XlaKernel, name)
    for name in ("forward", "attention", "dilated_forward"):
        record(native.NativeCpuKernel, name)
    return seen


def _inputs(t=256, h=4, d=16):
    x = jax.random.normal(jax.random.key(0), (1, t, h, d), jnp.float32)
    return x, x * 0.5, x * 0.25


def _first_call(seen, fn, *args):
    seen.clear()
    jax.jit(fn).lower(*args)
    assert seen, "no kernel method was entered"
    return seen[0]


def _sharded(fn, strategy="ring"):
    return jd.sharded(fn, build_mesh((4,), ("seq",), "auto"), seq_axis="seq",
                      strategy=strategy)


_DILATED_XLA = functools.partial(jd.dilated_attention, implementation="xla", **CFG)
_PACKED_IDS = jnp.repeat(jnp.arange(2), 128)[None]
_PATTERN = np.tril(np.ones((4, 4), bool))

# (path, the call, the kernel method it reaches, at most this many library frames:
# the entry point included, jd.sharded's own frames too on a mesh)
PATHS = [
    ("dilated, fused (native)", lambda q, k, v: jd.dilated_attention(q, k, v, **CFG),
     "NativeCpuKernel.dilated_forward", 4),
    ("dilated, streamed (xla)", _DILATED_XLA, "XlaKernel.forward", 5),
    ("dilated, packed rows (xla)",
     lambda q, k, v: _DILATED_XLA(q, k, v, segment_ids=_PACKED_IDS), "XlaKernel.forward", 5),
    ("dilated, decoding (xla)",
     lambda q, k, v: jd.dilated_attention_decode(q[:, :1], k, v, 200, implementation="xla",
                                                 **CFG), "XlaKernel.forward", 3),
    ("block-sparse, one device",
     lambda q, k, v: jd.block_sparse_attention(q, k, v, block_size=64, pattern=_PATTERN),
     "XlaKernel.block_sparse_forward", 11),
    ("dilated, mesh, ring", _sharded(_DILATED_XLA), "XlaKernel.forward", 10),
    ("dilated, mesh, heads", _sharded(_DILATED_XLA, "heads"), "XlaKernel.forward", 11),
    ("dilated, mesh, allgather", _sharded(_DILATED_XLA, "allgather"), "XlaKernel.forward",
     10),
    ("exact, mesh, ring", _sharded(functools.partial(jd.ring_attention, implementation="xla")),
     "XlaKernel.ring_steps", 11),
]


@pytest.mark.parametrize("name,fn,method,bound", PATHS, ids=[c[0] for c in PATHS])
def test_frames_to_the_kernel(kernel_calls, name, fn, method, bound):
    if "native" in name and native.unavailable_reason():
        # the fused path is the native kernel's: without a C++ compiler, on a CPU
        # without AVX2, or off Linux the XLA kernel serves and the path does not exist
        pytest.skip(native.unavailable_reason())
    got, frames = _first_call(kernel_calls, fn, *_inputs())
    assert got == method, (got, frames)
    assert len(frames) <= bound, f"{name}: {len(frames)} frames: " + " -> ".join(frames)


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
