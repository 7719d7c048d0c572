"""Kernel selection by device kind, and the cuDNN backend's wrapper logic, on CPU.

Selection is pure logic on *described* devices (simple objects with
``platform``/``device_kind``/``compute_capability``), so CI covers an H100, an
A100, a V100, an RTX 4090, an AMD GPU, a TPU and a CPU without any of them.

The cuDNN backend (``jax_dilated.backends.cudnn``) is tested with its fused
primitive injected: :class:`cudnn.ReferenceOps` implements the primitive's
contract (float32 stats; a backward from *given* stats and output, delta =
rowsum(do * o)) in dense pure JAX, so everything the backend does around the
primitive - layouts, the float32 lse, the custom_vjp through ``o`` *and*
``lse``, the widened-head backward that carries an arbitrary delta, global
statistics, fallbacks - is checked against float64 references and the XLA
kernel. On a machine with an NVIDIA GPU the same tests also run the real
primitive (the ``real_cudnn`` cases), which checks that cuDNN itself honours that
contract: they passed on an H100 (docs/benchmarks.md, "The GPU table").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_reference as ref
from _helpers import as_np, assert_close, to_torch
from _mesh import devices as mesh_devices

import jax_dilated as jd
from jax_dilated.backends import KernelArgs, call_specs, cudnn, native, registry, selection, xla
from jax_dilated.backends.base import BlockLists, Kernel, KernelBase, Masks
from jax_dilated.core import softmax


@dataclasses.dataclass(frozen=True)
class Dev:
    """A described device: what jax.Device exposes that selection reads."""

    platform: str
    device_kind: str
    compute_capability: str | None = None


H100 = Dev("gpu", "NVIDIA H100 80GB HBM3", "9.0")
H200 = Dev("gpu", "NVIDIA H200", "9.0")
A100 = Dev("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
RTX4090 = Dev("gpu", "NVIDIA GeForce RTX 4090", "8.9")
V100 = Dev("gpu", "Tesla V100-SXM2-16GB", "7.0")
MI300 = Dev("gpu", "AMD Instinct MI300X", "gfx942")
TPU = Dev("tpu", "TPU v5 lite")
CPU = Dev("cpu", "cpu")

def _real_cudnn_here() -> bool:
    return jax.default_backend() == "gpu" and registry.select_implementation(None) == "cudnn"


TOL_HALF = {"bfloat16": 2e-2, "float16": 5e-3}
HALF = {"bfloat16": jnp.bfloat16, "float16": np.float16}


# ------------------------------------------------------------------- selection


# a CPU gets the native kernel where it builds on this machine (jax_dilated/backends/native)
CPU_DEFAULT = "native" if native.unavailable_reason() is None else "xla"


@pytest.mark.parametrize("device, expected", [
    (H100, "cudnn"), (H200, "cudnn"), (A100, "cudnn"), (RTX4090, "cudnn"),
    (V100, "xla"), (MI300, "xla"), (TPU, "xla"), (CPU, CPU_DEFAULT),
])
def test_default_by_device_kind(device, expected):
    assert registry.select_implementation(None, device=device, software_reason=None) == expected
    assert registry.select_implementation("xla", device=device, software_reason=None) == "xla"


@pytest.mark.parametrize("device, match", [
    (V100, r"compute capability 7\.0.*>= 8\.0"),
    (MI300, r"not a CUDA device"),
    (TPU, r"'tpu', not an NVIDIA GPU"),
    (CPU, r"'cpu', not an NVIDIA GPU"),
])
def test_explicit_cudnn_refused_with_reason(device, match):
    with pytest.raises(ValueError, match=r"implementation=.cudnn. cannot run here: .*" + match):
        registry.select_implementation("cudnn", device=device, software_reason=None)


def test_missing_software_is_a_reason():
    why = "this JAX was installed without CUDA/cuDNN (jaxlib CPU-only build)"
    assert registry.select_implementation(None, device=H100, software_reason=why) == "xla"
    with pytest.raises(ValueError, match="without CUDA/cuDNN"):
        registry.select_implementation("cudnn", device=H100, software_reason=why)


CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu",
                              reason="describes a machine without accelerator")


@CPU_ONLY
def test_this_machine():
    """No GPU here: the default is the native CPU kernel where it builds (else the XLA
    kernel), and 'cudnn' is refused at selection."""
    assert registry.select_implementation(None) == CPU_DEFAULT
    assert registry.get_kernel(None) is (native.KERNEL if CPU_DEFAULT == "native"
                                         else xla.KERNEL)
    assert registry.get_kernel("xla") is xla.KERNEL
    with pytest.raises(ValueError, match="cannot run here"):
        registry.get_kernel("cudnn")
    with pytest.raises(ValueError, match=r"implementation must be.*'flash9'"):
        registry.get_kernel("flash9")
    # the installed CPU jaxlib has no cuDNN, and says so
    assert "CUDA" in (selection.cudnn_software_reason() or "CUDA")


@pytest.mark.parametrize("device, head_dim, ok", [
    (H100, 64, True), (H100, 128, True), (H100, 256, True), (H100, 264, False),
    (H100, 100, False), (A100, 128, True), (A100, 192, False), (RTX4090, 136, False),
])
def test_head_dim_limits(device, head_dim, ok):
    info = selection.describe_device(device)
    reason = selection.cudnn_call_reason(info, selection.CallSpec("bfloat16", head_dim))
    assert (reason is None) == ok, reason
    if not ok:
        with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
            registry.select_implementation("cudnn", device=device, head_dim=head_dim,
                                           software_reason=None)


@pytest.mark.parametrize("dtype, ok", [("bfloat16", True), ("float16", True),
                                       ("float32", False), ("float64", False)])
def test_dtypes(dtype, ok):
    info = selection.describe_device(H100)
    assert (selection.cudnn_call_reason(info, selection.CallSpec(dtype, 128)) is None) == ok
    if not ok:
        with pytest.raises(ValueError, match=f"dtype {dtype}"):
            registry.select_implementation("cudnn", device=H100, dtype=dtype,
                                           software_reason=None)


@pytest.mark.parametrize("spec, match", [
    (selection.CallSpec("bfloat16", 128, is_causal=True, positions="arbitrary"),
     "causal mask by position arrays"),
    (selection.CallSpec("bfloat16", 128, window=True, positions="arbitrary"),
     "a sliding window by position arrays"),
    (selection.CallSpec("bfloat16", 128, window=True, window_right=2), "right of the query"),
    (selection.CallSpec("bfloat16", 128, window=True, len_q=8, len_k=16), "len_q=8"),
    (selection.CallSpec("bfloat16", 128, window=True, is_causal=True, soft_cap=True),
     "soft-cap"),
    (selection.CallSpec("bfloat16", 128, kv_valid=True), "boolean kv mask"),
    (selection.CallSpec("bfloat16", 128, dropout=True), "dropout"),
    (selection.CallSpec("bfloat16", 128, len_q=8, len_k=16, is_causal=True), "len_q=8"),
    (selection.CallSpec("bfloat16", 128, block_sparse=True), "block-sparse"),
])
def test_mask_kinds_cudnn_cannot_serve(spec, match):
    reason = selection.cudnn_call_reason(selection.describe_device(H100), spec)
    assert reason is not None and match in reason


def test_mask_kinds_cudnn_serves():
    info = selection.describe_device(H100)
    for spec in (selection.CallSpec("bfloat16", 128),
                 selection.CallSpec("float16", 64, is_causal=True, len_q=32, len_k=32),
                 # non-causal: positions do not matter (ring steps without causality)
                 selection.CallSpec("bfloat16", 128, positions="arbitrary"),
                 selection.CallSpec("bfloat16", 128, len_q=8, len_k=16),
                 # a window ending at its query: cuDNN's causal mask with a left bound
                 selection.CallSpec("bfloat16", 128, window=True, is_causal=True),
                 selection.CallSpec("bfloat16", 128, window=True, len_q=32, len_k=32)):
        assert selection.cudnn_call_reason(info, spec) is None, spec


def test_augmented_backward_limits():
    a100, h100 = selection.describe_device(A100), selection.describe_device(H100)
    assert selection.augmented_backward_reason(a100, 128) is not None
    assert selection.augmented_backward_reason(a100, 120) is None
    assert selection.augmented_backward_reason(h100, 128) is None
    assert selection.augmented_backward_reason(h100, 256) is not None


def test_call_spec_positions():
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    causal = KernelArgs(scale=0.25, is_causal=True)
    assert call_specs.call_spec(q, q, causal).positions == "arange"
    assert call_specs.call_spec(q, q, causal, np.arange(8), np.arange(8)).positions == "arange"
    assert call_specs.call_spec(q, q, causal, np.arange(8) + 8, np.arange(8)).positions == \
        "arbitrary"
    seen = []
    jax.jit(lambda p: seen.append(call_specs.call_spec(q, q, causal, p, p).positions) or p)(
        jnp.arange(8))
    assert seen == ["arbitrary"]  # traced positions cannot be proven to be arange
    # without causality positions are irrelevant
    assert call_specs.call_spec(q, q, KernelArgs(scale=0.25), np.arange(8) + 3).positions == \
        "arange"


@CPU_ONLY
def test_describe_real_device():
    info = selection.describe_device(jax.devices()[0])
    assert info.platform == "cpu" and info.compute_capability is None
    assert selection.cudnn_device_reason(info) is not None


@pytest.mark.skipif(not _real_cudnn_here(), reason="needs an NVIDIA GPU with cuDNN")
def test_this_gpu(capsys):
    """On a GPU session: the real device is recognised and the defaults pick cuDNN."""
    info = selection.describe_device(jax.devices()[0])
    assert info.is_nvidia_gpu and info.compute_capability >= (8, 0), info
    assert selection.cudnn_software_reason() is None
    assert isinstance(registry.get_kernel(None), registry.AutoKernel)
    assert isinstance(registry.get_kernel("cudnn"), cudnn.CudnnKernel)
    rows = jd.backend_report()
    assert rows[0].kernel == "cudnn" and info.device_kind in capsys.readouterr().out


OPERATIONS = ("dilated_attention mode='longnet'", "dilated_attention mode='head_groups'",
              "ring_attention is_causal=False", "ring_attention is_causal=True",
              "dilated_attention(seq_axis=...) local branches",
              "dilated_attention(seq_axis=...) branches spanning devices",
              "block_sparse_attention", "dilated_attention_decode (KV cache)",
              "ring_attention / block_sparse_attention window=(left, right)",
              "dilated_attention jd.SlidingWindow branch",
              "logit_soft_cap=c (every operation)", "sinks= (every operation)",
              "dilated_attention mode='torchscale'")


@CPU_ONLY
def test_backend_report(capsys):
    rows = jd.backend_report()
    out = capsys.readouterr().out
    assert tuple(r.operation for r in rows) == OPERATIONS
    # this machine: a CPU; the native kernel (where it builds) serves bfloat16 too
    assert rows[0].kernel == CPU_DEFAULT and all(r.kernel in ("xla", CPU_DEFAULT) for r in rows)
    assert "cpu" in out and "not used" in out and "implementation='cudnn'" in out
    from jax_dilated.backends.native import gemm  # the dense products' line names the GEMM
    dense = gemm.library_name() or f"XLA's dot ({gemm.unavailable_reason()})"
    assert f"dense products of the layers and models (one device): {dense}" in out


@pytest.mark.parametrize("device, head_dim, expected", [
    (H100, 128, ["cudnn", "cudnn", "cudnn", "xla", "cudnn", "xla", "xla", "xla",
                 "xla", "cudnn", "xla", "cudnn", "cudnn"]),
    (A100, 128, ["cudnn", "cudnn", "cudnn", "xla", "cudnn", "xla", "xla", "xla",
                 "xla", "cudnn", "xla", "cudnn", "cudnn"]),
    (V100, 128, ["xla"] * 13),
    (TPU, 128, ["xla"] * 13),
    (H100, 512, ["xla"] * 13),
])
def test_backend_report_described(device, head_dim, expected):
    rows = jd.backend_report(device, head_dim=head_dim, quiet=True, software_reason=None)
    assert [r.kernel for r in rows] == expected
    by_op = {r.operation: r for r in rows}
    if device is A100:
        # longnet's and the ring's backward run from the global output (cuDNN's own);
        # the distributed local branches' lse-carrying one does not fit 128 + 8 there
        for i in (0, 1, 2):
            assert "backward on XLA" not in by_op[OPERATIONS[i]].reason
        assert "backward on XLA" in by_op[OPERATIONS[4]].reason
    if device is H100 and head_dim == 128:
        assert "global lse and output" in by_op[OPERATIONS[0]].reason
        assert "widened" in by_op[OPERATIONS[4]].reason
        # windows by position arrays (rings, block-sparse) and soft-caps are refused by
        # cuDNN, and the report says why; a window branch's causal window is cuDNN's
        assert "by position arrays" in by_op[OPERATIONS[8]].reason
        assert "sliding_window_length = left + 1" in by_op[OPERATIONS[9]].reason
        assert "soft-cap" in by_op[OPERATIONS[10]].reason
        assert "zero-padded copy" in by_op[OPERATIONS[12]].reason


# ------------------------------------------- the kernel classes, the module graph

KERNEL_METHODS = sorted(n for n, v in vars(Kernel).items()
                        if callable(v) and not n.startswith("_"))


def _kernels():
    strict = cudnn.CudnnKernel(ops=cudnn.ReferenceOps(), device=H100)
    return [xla.KERNEL, strict, registry.AutoKernel(strict)]


def test_every_backend_is_one_kernel_class():
    """Each backend is one class with every entry point and capability of the protocol,
    defined on the class or the explicit defaults of KernelBase (no attribute
    fall-through); get_kernel hands out instances."""
    assert KERNEL_METHODS == ["attention", "backward", "batch_chunk", "block_sparse_backward",
                              "block_sparse_forward", "block_sparse_ring_steps",
                              "call_reason", "dilated_backward", "dilated_forward", "forward",
                              "ring_steps"]
    for kern in _kernels():
        assert isinstance(kern, Kernel), kern
        assert isinstance(kern, KernelBase), kern
        assert not hasattr(type(kern), "__getattr__"), type(kern)
        classes = [c for c in type(kern).__mro__ if c is not object]
        assert all(any(name in vars(c) for c in classes) for name in KERNEL_METHODS), kern
        assert isinstance(kern.blockwise, bool) and isinstance(kern.fused_dilated, bool)
    assert isinstance(registry.get_kernel("xla"), xla.XlaKernel)
    # what each kernel declares: the XLA kernel is blockwise, only the native one fused
    assert (xla.KERNEL.blockwise, xla.KERNEL.fused_dilated) == (True, False)
    assert (native.KERNEL.blockwise, native.KERNEL.fused_dilated) == (True, True)
    assert (cudnn.KERNEL.blockwise, cudnn.KERNEL.fused_dilated) == (False, False)
    with pytest.raises(ValueError, match="no fused dilated program"):
        xla.KERNEL.dilated_forward(None, None, None, KernelArgs(scale=1.0), [])


def test_cudnn_kernel_says_what_it_lacks():
    """cuDNN has no block-sparse kernel and no ring steps: None from the step factories
    (a ring then calls forward/backward), a ValueError from the block-sparse calls; the
    automatic kernel sends block-sparse work to the XLA kernel, bit for bit."""
    xla_kern, strict, auto = _kernels()
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 8)), jnp.bfloat16)
    args = KernelArgs(scale=0.25, block_q=8, block_k=8)
    assert strict.ring_steps(q, q, args) is None
    assert strict.block_sparse_ring_steps(q, q, args) is None
    blocks = BlockLists(np.array([[0], [1]]), None, np.array([[0], [1]]), None)
    with pytest.raises(ValueError, match="no block-sparse kernel"):
        strict.block_sparse_forward(q, q, q, args, blocks=blocks)
    with pytest.raises(ValueError, match="no block-sparse kernel"):
        strict.block_sparse_backward(q, q, q, q, q[..., 0], q[..., 0], args, blocks=blocks)
    for got, want in zip(auto.block_sparse_forward(q, q, q, args, blocks=blocks),
                         xla_kern.block_sparse_forward(q, q, q, args, blocks=blocks)):
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(want, np.float32))
    assert type(auto.block_sparse_ring_steps(q, q, args)) is \
        type(xla_kern.block_sparse_ring_steps(q, q, args))


def _module_graph() -> dict[str, set[str]]:
    """``{module: modules of jax_dilated it imports}`` from the ``import`` statements of
    every module under ``jax_dilated/`` (function-level imports included).

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``; importing ``pkg.mod`` is an edge to ``pkg.mod`` only (not to ``pkg``,
    whose ``__init__`` Python runs first): a package's re-exports are edges from the
    package to its modules, never back.
    """
    import ast
    import pathlib

    root = pathlib.Path(jd.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: anchored at this module's package
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths
                           else base for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in paths and t != name)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state = {}  # name -> "open" (on the current path) or "done"
    path = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    """No module of jax_dilated imports, directly or through others, one that imports it
    back (e.g. cudnn and selection share cudnn_probe instead of importing each other)."""
    graph = _module_graph()
    assert "jax_dilated.backends.cudnn_probe" in graph["jax_dilated.backends.selection"]
    assert "jax_dilated.backends.cudnn" not in graph["jax_dilated.backends.selection"]
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))
    # the check itself finds a cycle when there is one
    assert _find_cycle({**graph, "jax_dilated.backends.cudnn_probe": {
        "jax_dilated.backends.cudnn"}}) is not None


# ------------------------------------------------- the cuDNN wrapper, on CPU


class RecordingOps:
    """Wraps a fused primitive and records the head width of every call (D, or D + 8 when
    the backward carries an arbitrary delta in widened columns)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def forward(self, q, k, v, **kw):
        self.calls.append(("forward", q.shape[-1]))
        return self.inner.forward(q, k, v, **kw)

    def backward(self, q, k, v, o, stats, do, **kw):
        self.calls.append(("backward", q.shape[-1]))
        return self.inner.backward(q, k, v, o, stats, do, **kw)


# Every wrapper test runs with the reference primitive on a described H100 (everywhere)
# and with the real cuDNN primitive on this machine's GPU (only where there is one):
# the GPU session runs this file as the cuDNN parity suite.
PRIMITIVES = [
    pytest.param("reference", id="reference_ops"),
    pytest.param("cudnn", id="real_cudnn", marks=pytest.mark.skipif(
        not _real_cudnn_here(), reason="needs an NVIDIA GPU (compute capability >= 8.0) "
                                       "and a JAX with cuDNN")),
]


@pytest.fixture(params=PRIMITIVES)
def primitive(request):
    """(recording ops, device) for the cuDNN kernel under test."""
    if request.param == "reference":
        return RecordingOps(cudnn.ReferenceOps()), H100
    return RecordingOps(cudnn.CudnnOps()), jax.devices()[0]


def _inputs(seed, n, lq, lk, h, hkv, d):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, lq, h, d))
    k = rng.standard_normal((n, lk, hkv, d))
    v = rng.standard_normal((n, lk, hkv, d))
    do = rng.standard_normal((n, lq, h, d))
    dlse = rng.standard_normal((n, lq, h))
    return q, k, v, do, dlse


def _half(x, dtype):
    return jnp.asarray(np.asarray(x).astype(HALF[dtype]))


def _rounded(x, dtype):
    return np.asarray(np.asarray(x).astype(HALF[dtype]), np.float64)


def _torch_dense(q, k, v, do, dlse, scale, causal, window=None, sinks=None):
    """float64 ``(o, lse, dq, dk, dv[, dsinks])`` through ``do`` and ``dlse`` (None: 0)."""
    qt, kt, vt = (to_torch(x, requires_grad=True) for x in (q, k, v))
    leaves = (qt, kt, vt) if sinks is None else (qt, kt, vt, to_torch(sinks, requires_grad=True))
    o, lse = ref.dense_attention(qt, kt, vt, scale=scale, is_causal=causal, return_lse=True,
                                 window=window, sinks=None if sinks is None else leaves[3])
    outs = [o, lse]
    cts = [to_torch(do), to_torch(dlse) if dlse is not None else torch.zeros_like(lse)]
    grads = torch.autograd.grad(outs, leaves, grad_outputs=cts)
    return tuple(as_np(x) for x in (o, lse, *grads))


CASES = [  # (name, N, Lq, Lk, H, Hkv, D, causal)
    ("dense", 2, 24, 24, 4, 4, 16, False),
    ("causal_gqa", 2, 32, 32, 4, 2, 16, True),
    ("lq_ne_lk_mqa", 1, 12, 40, 3, 1, 32, False),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("with_dlse", [True, False], ids=["do_dlse", "do_only"])
def test_cudnn_attention_vs_float64(primitive, case, dtype, with_dlse):
    """o, float32 lse and gradients (through o and lse) vs the float64 dense reference."""
    _, n, lq, lk, h, hkv, d, causal = case
    q, k, v, do, dlse = _inputs(1, n, lq, lk, h, hkv, d)
    q, k, v = (_rounded(x, dtype) for x in (q, k, v))
    scale = 0.3
    ops, device = primitive
    kern = cudnn.CudnnKernel(ops=ops, device=device)
    args = KernelArgs(scale=scale, is_causal=causal)

    @jax.jit
    def run(q, k, v, do, dlse):
        (o, lse, _), vjp = jax.vjp(lambda q, k, v: kern.attention(q, k, v, args), q, k, v)
        return (o, lse, *vjp((do, dlse, jnp.zeros_like(dlse))))

    @jax.jit
    def run_o_only(q, k, v, do):
        def loss(q, k, v):  # the caller says the lse is not differentiated
            o, *_ = kern.attention(q, k, v, args, lse_grad=False)
            return jnp.sum(o.astype(jnp.float32) * do)
        o, lse, _ = kern.forward(q, k, v, args)
        return (o, lse, *jax.grad(loss, (0, 1, 2))(q, k, v))

    hq, hk, hv = (_half(x, dtype) for x in (q, k, v))
    if with_dlse:
        got = run(hq, hk, hv, _half(do, dtype), jnp.asarray(dlse, jnp.float32))
    else:
        got = run_o_only(hq, hk, hv, jnp.asarray(_rounded(do, dtype), jnp.float32))
    want = _torch_dense(q, k, v, _rounded(do, dtype), dlse if with_dlse else None, scale,
                        causal)
    assert got[0].dtype == HALF[dtype] and got[1].dtype == jnp.float32
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert_close(a, b, TOL_HALF[dtype], name)
    widths = {w for kind, w in ops.calls if kind == "backward"}
    # an lse cotangent needs the widened head; without one cuDNN's own backward runs
    assert widths == ({d + selection.AUGMENT_COLUMNS} if with_dlse else {d})


@pytest.mark.parametrize("window, causal", [((5, 0), True), ((5, 0), False),
                                             ((0, 0), True), ((100, 0), True)],
                         ids=["left5_causal", "left5", "left0", "wider_than_seq"])
def test_cudnn_window_vs_float64(primitive, window, causal):
    """A window ending at its query runs on cuDNN (its causal mask with
    ``sliding_window_length = left + 1``): o, float32 lse and the gradients through both
    (the widened backward) and through o alone (cuDNN's own) vs the float64 reference.
    On a GPU this pins down cuDNN's window bound, (p - length, p]."""
    n, t, h, hkv, d = 2, 32, 4, 2, 16
    q, k, v, do, dlse = _inputs(5, n, t, t, h, hkv, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    ops, device = primitive
    kern = cudnn.CudnnKernel(ops=ops, device=device)
    args = KernelArgs(scale=0.3, is_causal=causal, window=window)
    half = [_half(x, "bfloat16") for x in (q, k, v, do)]
    assert kern.call_reason(half[0], half[1], args) is None

    @jax.jit
    def run(q, k, v, do, dlse):
        (o, lse, _), vjp = jax.vjp(lambda q, k, v: kern.attention(q, k, v, args), q, k, v)
        with_lse = vjp((do, dlse, jnp.zeros_like(dlse)))
        o_only = vjp((do, jnp.zeros_like(dlse), jnp.zeros_like(dlse)))
        return (o, lse, *with_lse), o_only

    got, got_o_only = run(*half, jnp.asarray(dlse, jnp.float32))
    want = _torch_dense(q, k, v, do, dlse, 0.3, causal, window)
    want_o_only = _torch_dense(q, k, v, do, None, 0.3, causal, window)[2:]
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert_close(a, b, TOL_HALF["bfloat16"], name)
    for name, a, b in zip(("dq", "dk", "dv"), got_o_only, want_o_only):
        assert_close(a, b, TOL_HALF["bfloat16"], name + " (o only)")
    # the window is cuDNN's, not dropped: without it the rows would differ
    assert window[0] >= t - 1 or not np.allclose(np.asarray(got[0], np.float64),
                           _torch_dense(q, k, v, do, dlse, 0.3, True)[0], atol=0.05)
    assert {kind for kind, _ in ops.calls} == {"forward", "backward"}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cudnn_sinks_vs_float64(primitive, causal):
    """Sinks folded into cuDNN's result (``Kernel.attention(sinks=)``): o, the
    sink-including float32 lse and the gradients of q, k, v and the sinks, through o
    and lse (the widened backward) and through o alone (cuDNN's own, given the
    sink-including o and lse), vs the float64 reference; one head's sink far above
    its logits."""
    n, t, h, hkv, d = 2, 32, 4, 2, 16
    q, k, v, do, dlse = _inputs(6, n, t, t, h, hkv, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    sinks = np.array([0.7, -1.5, 6.0, 0.0])
    ops, device = primitive
    kern = cudnn.CudnnKernel(ops=ops, device=device)
    args = KernelArgs(scale=0.3, is_causal=causal)

    def attend(q, k, v, s, lse_grad=True):
        return kern.attention(q, k, v, args, sinks=s, lse_grad=lse_grad)

    @jax.jit
    def run(q, k, v, s, do, dlse):
        (o, lse, _), vjp = jax.vjp(attend, q, k, v, s)
        o_only = jax.grad(lambda *a: jnp.sum(attend(*a, lse_grad=False)[0].astype(
            jnp.float32) * do), argnums=(0, 1, 2, 3))(q, k, v, s)  # the lse not differentiated
        return (o, lse, *vjp((do.astype(o.dtype), dlse, jnp.zeros_like(dlse)))), o_only

    half = [_half(x, "bfloat16") for x in (q, k, v)]
    got, got_o_only = run(*half, jnp.asarray(sinks, jnp.float32),
                          jnp.asarray(do, jnp.float32), jnp.asarray(dlse, jnp.float32))
    want = _torch_dense(q, k, v, do, dlse, 0.3, causal, sinks=sinks)
    want_o_only = _torch_dense(q, k, v, do, None, 0.3, causal, sinks=sinks)[2:]
    assert got[0].dtype == jnp.bfloat16 and got[-1].dtype == jnp.float32
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        assert_close(a, b, TOL_HALF["bfloat16"], name)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_o_only, want_o_only):
        assert_close(a, b, TOL_HALF["bfloat16"], name + " (o only)")
    assert {w for kind, w in ops.calls if kind == "backward"} == {d, d + selection.AUGMENT_COLUMNS}


def test_cudnn_backward_with_global_statistics(primitive):
    """backward on a key block with the global lse / delta equals the XLA kernel's (ring step)."""
    n, l, h, hkv, d = 2, 32, 4, 2, 16
    q, k, v, do, dlse = _inputs(2, n, l, 2 * l, h, hkv, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    # global statistics over all 2l keys (float64), the block is the first l keys
    o, lse, *_ = _torch_dense(q, k, v, do, dlse, 0.25, False)
    delta = np.einsum("nlhd,nlhd->nlh", do, o) - dlse
    args = KernelArgs(scale=0.25)
    blk = (q, k[:, :l], v[:, :l])
    ops, device = primitive
    kern = cudnn.CudnnKernel(ops=ops, device=device)
    half = [_half(x, "bfloat16") for x in (*blk, do)]
    stats32 = (jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32))
    got = jax.jit(lambda *a: kern.backward(*a, args))(*half, *stats32)
    # the XLA kernel on the same half-precision inputs and float32 statistics
    back = jax.jit(lambda *a: xla.backward(*a, args))
    want = back(*half, *stats32)
    # and in float64 (the exact block gradient given the global statistics)
    want64 = back(*(jnp.asarray(x) for x in (*blk, do)), jnp.asarray(lse), jnp.asarray(delta))
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want64):
        assert a.dtype == jnp.bfloat16
        assert_close(a, b, 2e-2, name + " vs xla bf16")
        assert_close(a, c, 2e-2, name + " vs float64")
    assert ops.calls == [("backward", d + selection.AUGMENT_COLUMNS)]


def test_backward_from_the_global_output(primitive):
    """``backward(..., out=o)`` with the global output (no lse cotangent, so ``delta =
    rowsum(do o)``) is one call of cuDNN's own backward, head not widened, and equals
    the float64 block gradient."""
    n, l, h, hkv, d = 2, 32, 4, 2, 16
    q, k, v, do, _ = _inputs(12, n, l, 2 * l, h, hkv, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    o, lse, *_ = _torch_dense(q, k, v, do, None, 0.25, False)
    delta = np.einsum("nlhd,nlhd->nlh", do, o)
    args = KernelArgs(scale=0.25)
    blk = (q, k[:, l:], v[:, l:])  # the second half of the keys this time
    ops, device = primitive
    kern = cudnn.CudnnKernel(ops=ops, device=device)
    half = [_half(x, "bfloat16") for x in (*blk, do)]
    got = jax.jit(lambda *a: kern.backward(*a[:6], args, out=a[6]))(
        *half, jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32),
        _half(o, "bfloat16"))
    want64 = xla.backward(*(jnp.asarray(x) for x in (*blk, do)), jnp.asarray(lse),
                          jnp.asarray(delta), args)
    for name, a, b in zip(("dq", "dk", "dv"), got, want64):
        assert a.dtype == jnp.bfloat16
        assert_close(a, b, 2e-2, name + " vs float64")
    assert ops.calls == [("backward", d)]


def test_delta_carried_to_float32_precision():
    """The three half-precision parts carry delta to ~2^-24 (not bf16's 2^-8), also
    inside a compiled program (on a GPU, XLA drops a float32 -> bfloat16 -> float32
    round trip inside a fusion; the parts must survive that)."""
    delta = jnp.asarray(np.random.default_rng(3).standard_normal(1000) * 37.0, jnp.float32)
    parts = jax.jit(cudnn._split3, static_argnums=1)(delta, jnp.bfloat16)
    total = sum(p.astype(jnp.float32) for p in parts)
    rel = np.max(np.abs(np.asarray(total) - np.asarray(delta)) / np.abs(np.asarray(delta)))
    assert rel < 1e-6, rel


def test_merge_of_two_partials(primitive):
    """Two key halves through the cuDNN kernel, merged by softmax.merge_partials: gradients
    flow through both partial lse's and equal dense attention over all keys."""
    n, l, h, d = 2, 24, 4, 16
    q, k, v, do, _ = _inputs(4, n, l, 2 * l, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    ops, device = primitive
    kern = cudnn.CudnnKernel(ops=ops, device=device)
    args = KernelArgs(scale=0.25)

    def merged(q, k, v):
        o1, *l1 = kern.attention(q, k[:, :l], v[:, :l], args)
        o2, *l2 = kern.attention(q, k[:, l:], v[:, l:], args)
        return softmax.merge_partials(o1.astype(jnp.float32), *l1,
                                      o2.astype(jnp.float32), *l2)[0]

    @jax.jit
    def run(q, k, v, do):
        o, vjp = jax.vjp(merged, q, k, v)
        return (o, *vjp(do))

    got = run(*(_half(x, "bfloat16") for x in (q, k, v)), jnp.asarray(do, jnp.float32))
    want = _torch_dense(q, k, v, do, None, 0.25, False)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want[:1] + want[2:]):
        assert_close(a, b, 2e-2, name)


def test_a100_head_128_lse_backward_falls_back_to_xla():
    """Where head_dim + 8 is over the limit, the lse-carrying backward runs on XLA (still exact)."""
    n, l, h, d = 1, 16, 2, 128
    q, k, v, do, dlse = _inputs(5, n, l, l, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    ops = RecordingOps(cudnn.ReferenceOps())
    kern = cudnn.CudnnKernel(ops=ops, device=A100)
    args = KernelArgs(scale=d ** -0.5, is_causal=True)
    @jax.jit
    def run(q, k, v, do, dlse):
        (o, lse, _), vjp = jax.vjp(lambda q, k, v: kern.attention(q, k, v, args), q, k, v)
        return (o, lse, *vjp((do, dlse, jnp.zeros_like(dlse))))

    got = run(*(_half(x, "bfloat16") for x in (q, k, v, do)), jnp.asarray(dlse, jnp.float32))
    want = _torch_dense(q, k, v, do, dlse, d ** -0.5, True)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert_close(a, b, 2e-2, name)
    assert ops.calls == [("forward", d)]  # no cuDNN backward call


@pytest.mark.parametrize("what, call, match", [
    ("float32", dict(dtype=jnp.float32), "dtype float32"),
    ("kv_valid", dict(kv_valid=True), "boolean kv mask"),
    ("dropout", dict(dropout=0.1), "dropout"),
    ("traced causal positions", dict(positions=True), "position arrays"),
])
def test_explicit_cudnn_kernel_refuses_calls(what, call, match):
    kern = cudnn.CudnnKernel(ops=cudnn.ReferenceOps(), device=H100)
    dtype = call.get("dtype", jnp.bfloat16)
    q = jnp.zeros((1, 8, 2, 16), dtype)
    args = KernelArgs(scale=0.25, is_causal=True, dropout_rate=call.get("dropout", 0.0))
    valid = jnp.ones((1, 8), bool) if call.get("kv_valid") else None

    def f(pos):
        p = pos if call.get("positions") else None
        return kern.forward(q, q, q, args, Masks(q_positions=p, k_positions=p,
                                                 kv_valid=valid,
                                                 dropout_rng=jax.random.key(0)))[0]

    with pytest.raises(ValueError, match=r"implementation='cudnn' cannot serve this call: .*"
                                         + match):
        jax.jit(f)(jnp.arange(8))


# ------------------------------------- the operations, on a described GPU


@pytest.fixture(params=PRIMITIVES)
def described_gpu(request, monkeypatch):
    """The registry on a GPU with cuDNN, the fused primitive recorded: a described H100
    with the reference primitive (everywhere), or this machine's GPU (where there is one).
    Returns the recording ops."""
    if request.param == "reference":
        ops, device = RecordingOps(cudnn.ReferenceOps()), H100
        real = registry.select_implementation

        def select(implementation, **kw):
            kw["device"], kw["software_reason"] = H100, None
            return real(implementation, **kw)

        monkeypatch.setattr(registry, "select_implementation", select)
    else:
        ops, device = RecordingOps(cudnn.CudnnOps()), jax.devices()[0]
    auto = registry.AutoKernel(cudnn.CudnnKernel(ops=ops, device=device))
    strict = cudnn.CudnnKernel(ops=ops, device=device)
    monkeypatch.setattr(registry, "_auto_for", lambda device: auto)
    monkeypatch.setattr(registry, "_cudnn_for", lambda device: strict)
    return ops


@pytest.mark.parametrize("mode", ["longnet", "head_groups"])
@pytest.mark.parametrize("seq_len", [64, 72], ids=["whole_segments", "short_tail"])
def test_dilated_attention_on_described_gpu(described_gpu, mode, seq_len):
    """jd.dilated_attention with implementation=None on a (described) H100: cuDNN serves the
    calls it can, XLA the rest, and output and gradients match the float64 XLA kernel."""
    ops = described_gpu
    b, h, d = 2, 4, 16
    q, k, v, do, _ = _inputs(6, b, seq_len, seq_len, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    cfg = dict(segment_lengths=(16, 32), dilation_rates=(1, 2), mode=mode, is_causal=True)

    def run(impl, dtype):
        cast = (lambda x: _half(x, "bfloat16")) if dtype == "bfloat16" else jnp.asarray

        @jax.jit
        def f(q, k, v, do):
            o, vjp = jax.vjp(lambda q, k, v: jd.dilated_attention(
                q, k, v, implementation=impl, **cfg), q, k, v)
            return (o, *vjp(do))

        return f(cast(q), cast(k), cast(v), cast(do))

    got = run(None, "bfloat16")
    want = run("xla", "float64")
    for name, a, b_ in zip(("o", "dq", "dk", "dv"), got, want):
        assert_close(a, b_, 2e-2, name)
    fwd = [w for kind, w in ops.calls if kind == "forward"]
    bwd = {w for kind, w in ops.calls if kind == "backward"}
    # 64 = whole segments: both branches on cuDNN; 72: the short tails carry a key
    # mask, so those calls run on XLA - with these lengths every branch has one
    assert len(fwd) == (2 if seq_len == 64 else 0)
    if seq_len == 64:
        # cuDNN's own backward in both modes: longnet's branches run from the merged
        # output's statistics (Kernel.backward(out=)), not through a merge's lse
        # cotangent, which would take the widened head (d + 8)
        assert bwd == {d}
    # the explicit request fails at trace time for the masked calls, saying why
    if seq_len == 72:
        with pytest.raises(ValueError, match="boolean kv mask"):
            jd.dilated_attention(_half(q, "bfloat16"), _half(k, "bfloat16"),
                                 _half(v, "bfloat16"), implementation="cudnn", **cfg)


def test_longnet_outside_grad_runs_batched_on_described_gpu(described_gpu, monkeypatch):
    """Longnet on cuDNN: a call outside grad runs the batched program (one call per
    branch, merged after), a differentiated one the streamed program whose backward
    is cuDNN's own; both equal the float64 XLA kernel's output."""
    from jax_dilated.ops import branch_combine

    ran = []
    real = branch_combine.batched
    monkeypatch.setattr(branch_combine, "batched", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    b, t, h, d = 2, 64, 4, 16
    q, k, v, do, _ = _inputs(8, b, t, t, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    cfg = dict(segment_lengths=(16, 32), dilation_rates=(1, 2), mode="longnet", is_causal=True)
    half = [_half(x, "bfloat16") for x in (q, k, v, do)]
    plain = jax.jit(lambda q, k, v: jd.dilated_attention(q, k, v, **cfg))(*half[:3])
    assert ran == [1]
    o, vjp = jax.jit(lambda q, k, v, do: (lambda o, f: (o, f(do)))(
        *jax.vjp(lambda q, k, v: jd.dilated_attention(q, k, v, **cfg), q, k, v)))(*half)
    assert ran == [1]  # the differentiated call did not run it
    want = jax.jit(lambda q, k, v: jd.dilated_attention(q, k, v, implementation="xla", **cfg))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))  # (op by op: most of the test's time)
    assert_close(plain, want, 2e-2, "outside grad")
    assert_close(o, want, 2e-2, "under vjp")
    assert {w for kind, w in described_gpu.calls if kind == "backward"} == {d}


def test_longnet_lse_cotangent_on_described_gpu(described_gpu):
    """A loss on longnet's log-sum-exp too: the branches' backward must carry
    ``delta - dlse``, which cuDNN's own backward cannot, so it takes the widened head;
    output and gradients still match the float64 XLA kernel."""
    ops = described_gpu
    b, t, h, d = 2, 64, 4, 16
    q, k, v, do, dlse = _inputs(9, b, t, t, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    cfg = dict(segment_lengths=(16, 32), dilation_rates=(1, 2), mode="longnet",
               is_causal=True, return_lse=True)

    def run(impl, cast):
        @jax.jit
        def f(q, k, v, do, dlse):
            out, vjp = jax.vjp(lambda q, k, v: jd.dilated_attention(
                q, k, v, implementation=impl, **cfg), q, k, v)
            return (*out, *vjp((do, dlse.astype(out[1].dtype))))

        return f(cast(q), cast(k), cast(v), cast(do), jnp.asarray(dlse))

    got = run(None, lambda x: _half(x, "bfloat16"))
    want = run("xla", jnp.asarray)
    for name, a, b_ in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert_close(a, b_, 2e-2, name)
    assert {w for kind, w in ops.calls if kind == "backward"} == {d + selection.AUGMENT_COLUMNS}


def test_float32_falls_back_per_call(described_gpu):
    ops = described_gpu
    x = jnp.ones((1, 32, 2, 16), jnp.float32)
    jd.dilated_attention(x, x, x, segment_lengths=(16,), dilation_rates=(1,))
    assert ops.calls == []
    with pytest.raises(ValueError, match="dtype float32"):
        jd.dilated_attention(x, x, x, segment_lengths=(16,), dilation_rates=(1,),
                             implementation="cudnn")


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_on_described_gpu(described_gpu, causal):
    """ring_attention over 2 CPU devices: non-causal steps on cuDNN (backward with the global
    lse and output: cuDNN's own backward, head not widened), causal steps (position
    arrays) on XLA."""
    ops = described_gpu
    b, t, h, d = 1, 64, 2, 16
    q, k, v, do, _ = _inputs(7, b, t, t, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    mesh = jax.sharding.Mesh(mesh_devices(2), ("seq",))
    attn = jd.sharded(functools.partial(jd.ring_attention, is_causal=causal), mesh,
                      seq_axis="seq")
    @jax.jit
    def run(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))

    got = run(*(_half(x, "bfloat16") for x in (q, k, v, do)))
    want = _torch_dense(q, k, v, do, None, d ** -0.5, causal)
    for name, a, b_ in zip(("o", "dq", "dk", "dv"), got, want[:1] + want[2:]):
        assert_close(a, b_, 2e-2, name)
    kinds = {kind for kind, _ in ops.calls}
    assert kinds == (set() if causal else {"forward", "backward"})
    assert {w for kind, w in ops.calls if kind == "backward"} == (set() if causal else {d})


@CPU_ONLY
def test_layer_refuses_cudnn_when_built():
    """A layer asking for cuDNN on a machine without it fails when it is built, not later."""
    from flax import nnx
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run here"):
        jd.nnx.MultiheadDilatedAttention(32, 4, segment_lengths=(16,), dilation_rates=(1,),
                                         implementation="cudnn", rngs=nnx.Rngs(0))
    layer = jd.nnx.MultiheadDilatedAttention(32, 4, segment_lengths=(16,), dilation_rates=(1,),
                                             rngs=nnx.Rngs(0))  # default: by device kind
    assert layer(jnp.ones((1, 32, 32))).shape == (1, 32, 32)


@pytest.mark.parametrize("causal", [False, True])
def test_distributed_dilated_on_described_gpu(described_gpu, causal):
    """dilated_attention(seq_axis=...) over 2 devices: local branches (w=16) and a branch
    spanning both devices (w=64, a ring) with the default kernel; equals float64 XLA."""
    ops = described_gpu
    b, t, h, d = 1, 64, 4, 16
    q, k, v, do, _ = _inputs(8, b, t, t, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    mesh = jax.sharding.Mesh(mesh_devices(2), ("seq",))

    def run(impl, cast, segments=(16, 64), rates=(1, 2)):
        attn = jd.sharded(functools.partial(jd.dilated_attention, implementation=impl,
                                            segment_lengths=segments, dilation_rates=rates,
                                            is_causal=causal), mesh, seq_axis="seq")

        @jax.jit
        def f(q, k, v, do):
            o, vjp = jax.vjp(attn, q, k, v)
            return (o, *vjp(do))

        return f(*(cast(x) for x in (q, k, v, do)))

    got = run(None, lambda x: _half(x, "bfloat16"))
    want = run("xla", jnp.asarray)
    for name, a, b_ in zip(("o", "dq", "dk", "dv"), got, want):
        assert_close(a, b_, 2e-2, name)
    # the local branch always runs on cuDNN; the ring's steps only when non-causal.
    # Counted as traced calls, not runs (jd.sharded's jit traces a differentiated
    # call twice: its primal and its forward rule), against the local branch alone.
    traced = len([c for c in ops.calls if c[0] == "forward"])
    ops.calls.clear()
    run(None, lambda x: _half(x, "bfloat16"), segments=(16,), rates=(1,))
    local_only = len([c for c in ops.calls if c[0] == "forward"])
    assert local_only >= 1 and (traced == local_only if causal else traced > local_only), (
        traced, local_only)


def test_eager_shard_map_on_described_gpu(described_gpu):
    """The cuDNN kernel inside a ``jax.shard_map`` run eagerly (no jit), as in a notebook:
    the forward and the gradients equal float64 XLA. (JAX refuses a ``custom_vjp`` with
    ``symbolic_zeros`` there, NotImplementedError, even in a call not differentiated:
    the kernel's differentiable call must not use one.) One-device dilated attention
    on each device's shard, head_groups, whose calls run their backward from their
    output (the lse is not returned)."""
    b, t, h, d = 1, 64, 4, 16
    q, k, v, do, _ = _inputs(9, b, t, t, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    mesh = jax.sharding.Mesh(mesh_devices(2), ("seq",))
    body = functools.partial(jd.dilated_attention, segment_lengths=(16, 32),
                             dilation_rates=(1, 2), is_causal=True, mode="head_groups")
    spec = jax.sharding.PartitionSpec(None, "seq")

    def run(impl, cast, compile):
        f = jax.shard_map(functools.partial(body, implementation=impl), mesh=mesh,
                          in_specs=(spec,) * 3, out_specs=spec)

        def forward_and_grads(*args):
            grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cast(do)),
                             argnums=(0, 1, 2))(*args)
            return (f(*args), *grads)

        return (jax.jit(forward_and_grads) if compile else forward_and_grads)(
            *(cast(x) for x in (q, k, v)))

    got = run(None, lambda x: _half(x, "bfloat16"), compile=False)
    want = run("xla", jnp.asarray, compile=True)
    for name, a, b_ in zip(("o", "dq", "dk", "dv"), got, want):
        assert_close(a, b_, 2e-2, name)
    assert {w for kind, w in described_gpu.calls if kind == "backward"} == {d}


@pytest.mark.parametrize("kernel", ["xla", "cudnn"])
def test_lse_grad_false_stops_the_lse_gradient(kernel):
    """``Kernel.attention(lse_grad=False)``: the log-sum-exp carries no gradient (both
    parts), the output the same gradient as with ``lse_grad=True``."""
    n, t, h, d = 2, 32, 2, 16
    q, k, v, do, dlse = _inputs(10, n, t, t, h, h, d)
    q, k, v = (_half(_rounded(x, "bfloat16"), "bfloat16") for x in (q, k, v))
    kern = (xla.KERNEL if kernel == "xla"
            else cudnn.CudnnKernel(ops=cudnn.ReferenceOps(), device=H100))
    args = KernelArgs(scale=0.3, is_causal=True)
    do = jnp.asarray(do, jnp.float32)

    def loss(lse_grad, part, q, k, v):
        o, lse, lse_lo = kern.attention(q, k, v, args, lse_grad=lse_grad)
        return {"o": jnp.sum(o.astype(jnp.float32) * do), "lse": jnp.sum(lse * dlse),
                "lse_lo": jnp.sum(lse_lo * dlse)}[part]

    grad = jax.jit(jax.grad(loss, argnums=(2, 3, 4)), static_argnums=(0, 1))
    for part in ("lse", "lse_lo"):
        for g in grad(False, part, q, k, v):
            assert not np.any(np.asarray(g, np.float32)), part
    assert np.any(np.asarray(grad(True, "lse", q, k, v)[0], np.float32))
    for a, b_ in zip(grad(False, "o", q, k, v), grad(True, "o", q, k, v)):
        assert_close(a, b_, 2e-2, "do")


@pytest.mark.parametrize("strategy", ["ring", "allgather", "heads"])
def test_distributed_head_groups_backward_from_output(described_gpu, strategy):
    """head_groups dilated attention over 2 devices without ``return_lse``: each head's
    lse is its branch's and nothing differentiates through it, so every cuDNN backward
    (local branch, the spanning branch's ring steps, all-gather or head-exchanged
    calls) runs from its output (head not widened); with ``return_lse`` and an lse
    cotangent they widen. Both equal float64 XLA."""
    ops = described_gpu
    b, t, h, d = 1, 64, 4, 16
    q, k, v, do, dlse = _inputs(11, b, t, t, h, h, d)
    q, k, v, do = (_rounded(x, "bfloat16") for x in (q, k, v, do))
    mesh = jax.sharding.Mesh(mesh_devices(2), ("seq",))

    def run(impl, cast, return_lse):
        attn = jd.sharded(functools.partial(
            jd.dilated_attention, implementation=impl, segment_lengths=(16, 64),
            dilation_rates=(1, 2), mode="head_groups", strategy=strategy,
            return_lse=return_lse), mesh, seq_axis="seq")

        @jax.jit
        def f(q, k, v, do, dlse):
            out, vjp = jax.vjp(attn, q, k, v)
            return (*out, *vjp((do, dlse))) if return_lse else (out, *vjp(do))

        stats = softmax.stats_dtype(cast(q).dtype)  # the lse's dtype
        return f(*(cast(x) for x in (q, k, v, do)), jnp.asarray(dlse, stats))

    for return_lse in (False, True):
        ops.calls.clear()
        got = run(None, lambda x: _half(x, "bfloat16"), return_lse)
        widths = {w for kind, w in ops.calls if kind == "backward"}
        want = run("xla", jnp.asarray, return_lse)
        names = ("o", "lse", "dq", "dk", "dv") if return_lse else ("o", "dq", "dk", "dv")
        for name, a, b_ in zip(names, got, want):
            assert_close(a, b_, 2e-2, f"{name} (return_lse={return_lse})")
        assert widths == ({d + selection.AUGMENT_COLUMNS} if return_lse else {d}), widths


def test_widened_backward_in_chunks():
    """A segment batch whose widened operands exceed the budget runs in chunks (lax.map),
    with the same gradients as one call (here 5 segments in chunks of 2, one padded)."""
    n, l, h, d = 5, 16, 2, 16
    q, k, v, do, dlse = _inputs(9, n, l, l, h, h, d)
    half = [_half(x, "bfloat16") for x in (q, k, v, do)]
    rng = np.random.default_rng(10)
    lse = jnp.asarray(rng.standard_normal((n, l, h)) + 3.0, jnp.float32)
    delta = jnp.asarray(rng.standard_normal((n, l, h)), jnp.float32)
    args = KernelArgs(scale=0.25, is_causal=True)
    whole_ops, chunk_ops = RecordingOps(cudnn.ReferenceOps()), RecordingOps(cudnn.ReferenceOps())
    whole = cudnn.CudnnKernel(ops=whole_ops, device=H100)
    per_segment = 5 * l * h * (d + selection.AUGMENT_COLUMNS) * 2  # bytes, bf16
    chunked = cudnn.CudnnKernel(ops=chunk_ops, device=H100,
                                widen_chunk_bytes=2 * per_segment)
    got = jax.jit(lambda *a: chunked.backward(*a, args))(*half, lse, delta)
    want = jax.jit(lambda *a: whole.backward(*a, args))(*half, lse, delta)
    for name, a, b_ in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b_.shape
        assert_close(a, b_, 1e-6, name)
    assert "while" in jax.jit(lambda *a: chunked.backward(*a, args)).lower(
        *half, lse, delta).as_text()


# The real primitive bound and lowered for CUDA (no GPU needed, no torch either):
# tests/test_cudnn_lowering.py, which CI also runs on the newest JAX.
