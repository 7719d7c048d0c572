"""Small helpers shared by the parity tests: random inputs, conversion, comparison;
the marker of the compiled-memory tests (XLA:CPU only)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # the PyTorch references need it; the pure-JAX helpers below do not
    import torch
except ImportError:  # Python other than 3.11 (torch is pinned for 3.11 only)
    torch = None

# tolerance relative to the reference's largest magnitude, per JAX dtype
TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2}

# The bounds on compiled memory (XLA's temp buffers, ``memory_analysis``) were measured
# on XLA:CPU: they are properties of its schedule. Another backend's compiler schedules
# and fuses differently (on an H100 one sinks bound read +45.8 MB against 8.4 MB), so
# these tests run on CPU only.
XLA_CPU_MEMORY = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason=f"a compiled-memory bound of XLA:CPU's schedule; the default backend here is "
           f"{jax.default_backend()!r}, whose compiler schedules differently")


def np_dtype(name: str):
    return {"float64": np.float64, "float32": np.float32,
            "bfloat16": jnp.bfloat16}[name]


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float64 (what the reference sees)."""
    return np.asarray(x.astype(np_dtype(dtype)), dtype=np.float64)


def to_jax(x: np.ndarray, dtype: str):
    """A JAX array of exactly ``dtype`` (x64 is on, so never rely on defaults)."""
    out = jnp.asarray(x.astype(np_dtype(dtype)))
    assert out.dtype == jnp.dtype(np_dtype(dtype)), (out.dtype, dtype)
    return out


def to_torch(x: np.ndarray, requires_grad: bool = False) -> "torch.Tensor":
    t = torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float64)
    return t.requires_grad_(requires_grad)


def as_np(x) -> np.ndarray:
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


# Errors are measured relative to max(max |reference|, ABS_FLOOR). The tests draw
# standard-normal inputs, so order 1 is the natural scale of every quantity; the
# floor only matters when a reference vanishes analytically (e.g. dq when every
# query sees only itself), where both sides hold pure rounding noise (~1e-16 in
# float64, ~1e-7 in float32) and a ratio to ~0 would be meaningless.
ABS_FLOOR = 1.0


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max(max |expected|, ABS_FLOOR).

    Non-finite entries (``-inf`` log-sum-exps) must coincide exactly.
    """
    a, e = as_np(actual), as_np(expected)
    assert a.shape == e.shape, (a.shape, e.shape)
    finite = np.isfinite(e)
    assert np.array_equal(np.isfinite(a), finite), "non-finite entries differ"
    assert np.array_equal(a[~finite], e[~finite]), "infinite entries differ"
    scale = max(np.max(np.abs(e[finite]), initial=0.0), ABS_FLOOR)
    return float(np.max(np.abs(a[finite] - e[finite]), initial=0.0) / scale)


def assert_close(actual, expected, tol: float, what: str = ""):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def output_and_grads(f, q, k, v, g):
    """``[out, dq, dk, dv]`` of ``sum(g * f(q, k, v))`` as float64 NumPy arrays, jitted:
    the output and the gradients of q, k, v through the random cotangent ``g``."""
    def loss(q, k, v):
        out = f(q, k, v)
        return jnp.sum(out.astype(jnp.float64) * g), out

    (dq, dk, dv), out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float64) for x in (out, dq, dk, dv)]


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The replica groups of the collective on ``line`` of a text HLO program: explicit
    ``{{0,1},{2,3}}``, the iota form ``[G,S]<=[dims]T(perm)``, the mesh-axes form of
    newer XLA ``mesh['a'=2,'b'=4] {'a'}`` (the devices, numbered in mesh order, that
    differ only along the axes named), or none (all devices in one group)."""
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        groups = [[int(x) for x in g.split(",") if x]
                  for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
        return [g for g in groups if g] or [list(range(num_devices))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                     line)
    if iota:
        dims = [int(x) for x in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(x) for x in iota.group(4).split(",")])
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        axes = re.findall(r"'?(\w+)'?=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        inner = [names.index(a) for a in re.findall(r"'?(\w+)'?", mesh.group(2))]
        outer = [i for i in range(len(names)) if i not in inner]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(outer + inner)
        return ids.reshape(-1, math.prod(sizes[i] for i in inner)).tolist()
    return [list(range(num_devices))]


def hlo_computations(hlo: str):
    """``({name: [instruction lines]}, entry name)`` of an HLO module's text (names with
    or without the ``%`` the compiled text gives them)."""
    comps, cur, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?(\S+) .*\{\s*$", line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and line.strip():
            comps[cur].append(line.strip())
    return comps, entry
