"""Which kernel can serve a call, decided from static facts only.

Everything here is pure Python on static information (no arrays, no devices
touched beyond reading their attributes), so it runs at trace time and is
unit-tested on CPU with *described* devices: any object with ``platform``,
``device_kind`` and (for NVIDIA GPUs) ``compute_capability`` will do.

Two questions are answered:

* :func:`cudnn_device_reason` - can this *device* (with this JAX) run the cuDNN
  fused-attention kernel at all? (NVIDIA GPU with CUDA, compute capability
  >= 8.0, JAX built with cuDNN and exposing the primitives the backend binds.)
* :func:`cudnn_call_reason` - can the cuDNN kernel serve this *call*? (dtype,
  head_dim, mask kind, dropout, lengths.)

Both return ``None`` when the answer is yes and otherwise a sentence saying why
not; the registry turns that into a fallback (``implementation=None``) or a
``ValueError`` (``implementation="cudnn"``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dilated.backends import cudnn_probe
from jax_dilated.backends.cudnn_probe import cudnn_software_reason

__all__ = ["DeviceInfo", "CallSpec", "describe_device", "cudnn_software_reason",
           "cudnn_device_reason", "cudnn_call_reason", "cudnn_max_head_dim",
           "CUDNN_DTYPES", "CUDNN_MIN_CAPABILITY", "AUGMENT_COLUMNS"]

# cuDNN flash attention (the fused kernel JAX's cudnn path lowers to) runs on
# Ampere (sm_80) and later; Hopper (9.0) raises the head_dim limit to 256.
CUDNN_MIN_CAPABILITY = (8, 0)
CUDNN_DTYPES = ("bfloat16", "float16")
# Extra head-dim columns the generic backward (an arbitrary delta, i.e. a
# log-sum-exp cotangent or a global delta) appends; see cudnn.py.
AUGMENT_COLUMNS = 8


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What selection needs to know about a device.

    platform: ``"cpu"``, ``"gpu"`` (or ``"cuda"``/``"rocm"``), ``"tpu"``, ...
    device_kind: e.g. ``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``, ``"cpu"``.
    compute_capability: ``(major, minor)`` for NVIDIA GPUs, else None.
    runtime: ``"cuda"``, ``"rocm"`` or None (from the client's platform_version
      when the device has one; inferred from the other fields otherwise).
    """

    platform: str
    device_kind: str
    compute_capability: tuple[int, int] | None = None
    runtime: str | None = None

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.platform in ("gpu", "cuda") and self.runtime == "cuda"

    def __str__(self):
        cc = ("" if self.compute_capability is None
              else f", compute capability {self.compute_capability[0]}."
                   f"{self.compute_capability[1]}")
        return f"{self.device_kind} ({self.platform}{cc})"


def _parse_capability(value) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, tuple) and len(value) == 2:
        return int(value[0]), int(value[1])
    try:
        major, minor = str(value).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None  # e.g. a ROCm "gfx90a" string


def describe_device(device) -> DeviceInfo:
    """A :class:`DeviceInfo` from a ``jax.Device`` (or any object with the same attributes)."""
    if isinstance(device, DeviceInfo):
        return device
    platform = str(getattr(device, "platform", "unknown")).lower()
    kind = str(getattr(device, "device_kind", platform))
    cc = _parse_capability(getattr(device, "compute_capability", None))
    runtime = None
    client = getattr(device, "client", None)
    version = str(getattr(client, "platform_version", "") or "").lower()
    if "cuda" in version:
        runtime = "cuda"
    elif "rocm" in version or "hip" in version:
        runtime = "rocm"
    elif platform == "cuda":
        runtime = "cuda"
    elif platform == "rocm":
        runtime = "rocm"
    elif platform == "gpu":
        # described devices (tests) or clients without a version string: an
        # NVIDIA device kind with a numeric compute capability is CUDA.
        if cc is not None and not kind.upper().startswith("AMD"):
            runtime = "cuda"
    return DeviceInfo(platform, kind, cc, runtime)


def cudnn_device_reason(device, software_reason: str | None = "detect") -> str | None:
    """Why ``device`` cannot run the cuDNN backend, or None if it can.

    ``software_reason``: ``"detect"`` checks the installed JAX
    (:func:`.cudnn_probe.cudnn_software_reason`, re-exported here); tests pass
    ``None`` (software present) or a string to describe a machine.
    """
    info = describe_device(device)
    if info.platform not in ("gpu", "cuda", "rocm"):
        return f"the device is {info.platform!r}, not an NVIDIA GPU ({info.device_kind})"
    if info.runtime != "cuda":
        return f"{info.device_kind} is not a CUDA device (cuDNN is NVIDIA-only)"
    cc = info.compute_capability
    if cc is None:
        return f"{info.device_kind} reports no compute capability"
    if cc < CUDNN_MIN_CAPABILITY:
        return (f"{info.device_kind} has compute capability {cc[0]}.{cc[1]}; cuDNN flash "
                f"attention needs >= {CUDNN_MIN_CAPABILITY[0]}.{CUDNN_MIN_CAPABILITY[1]} "
                f"(Ampere or later)")
    if software_reason == "detect":
        software_reason = cudnn_software_reason()
        if software_reason is None and cc == (10, 3):
            version = cudnn_probe.cudnn_version()
            if version is not None and version < 91100:
                software_reason = (f"compute capability 10.3 needs cuDNN >= 9.11, this JAX "
                                   f"has {version}")
    return software_reason


def cudnn_max_head_dim(info: DeviceInfo) -> int:
    """Largest head_dim cuDNN flash attention accepts on this device (a multiple of 8)."""
    cc = info.compute_capability or (0, 0)
    return 256 if cc >= (9, 0) else 128


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """The static facts of one kernel call (or of a typical call of an operation).

    positions: ``"arange"`` (None, or concrete arrays equal to ``arange``) or
      ``"arbitrary"`` (traced or other position arrays, as ring steps pass).
    kv_valid: whether a boolean key mask is given.
    block_sparse: a block-sparse call (listed blocks only).
    window: a sliding window (``KernelArgs.window``) is given.
    window_right: how far right of its query the window reaches (``window[1]``;
      0 for causal calls, whose window ends at the query).
    soft_cap: a logit soft-cap (``KernelArgs.logit_soft_cap``) is given.
    """

    dtype: str
    head_dim: int
    len_q: int | None = None
    len_k: int | None = None
    is_causal: bool = False
    positions: str = "arange"
    kv_valid: bool = False
    dropout: bool = False
    block_sparse: bool = False
    window: bool = False
    window_right: int = 0
    soft_cap: bool = False


# The native CPU kernel (jax_dilated/backends/native): what it computes (half-precision
# inputs converted to float32 in the kernel, results in the input dtype).
NATIVE_DTYPES = ("float32", "bfloat16", "float16")
NATIVE_MAX_HEAD_DIM = 256


def native_call_reason(spec: CallSpec) -> str | None:
    """Why the native CPU kernel cannot serve a call described by ``spec``, or None
    (whether it is built on this machine is :func:`jax_dilated.backends.native.
    unavailable_reason`)."""
    if spec.block_sparse:
        return "block-sparse calls (the XLA kernel's listed blocks)"
    dtype = np.dtype(spec.dtype).name if not isinstance(spec.dtype, str) else spec.dtype
    if dtype not in NATIVE_DTYPES:
        return f"dtype {dtype} (the native kernel takes float32, bfloat16 or float16)"
    if spec.head_dim % 16 or spec.head_dim > NATIVE_MAX_HEAD_DIM:
        return (f"head_dim {spec.head_dim} (the native kernel needs a multiple of 16 up "
                f"to {NATIVE_MAX_HEAD_DIM})")
    if spec.dropout:
        return "dropout"
    if spec.window:
        return "a sliding window"
    if spec.soft_cap:
        return "logit soft-capping"
    if spec.positions == "arbitrary":
        return "positions other than 0..L-1 (causal ring steps)"
    return None


def cudnn_call_reason(info: DeviceInfo, spec: CallSpec) -> str | None:
    """Why the cuDNN kernel cannot serve a call described by ``spec``, or None."""
    if spec.block_sparse:
        return "block-sparse calls (cuDNN has no block-sparse attention kernel)"
    dtype = np.dtype(spec.dtype).name if not isinstance(spec.dtype, str) else spec.dtype
    if dtype not in CUDNN_DTYPES:
        return (f"dtype {dtype} (cuDNN flash attention takes bfloat16 or float16; "
                f"float32/float64 run on the XLA kernel)")
    limit = cudnn_max_head_dim(info)
    if spec.head_dim % 8 or spec.head_dim > limit:
        return (f"head_dim {spec.head_dim} (cuDNN needs a multiple of 8 and at most "
                f"{limit} on compute capability "
                f"{'.'.join(map(str, info.compute_capability or (0, 0)))})")
    if spec.soft_cap:
        return ("logit soft-capping (cuDNN's fused attention, as jax.nn."
                "dot_product_attention exposes it, has no soft-cap)")
    if spec.window and spec.window_right > 0:
        return (f"a sliding window reaching {spec.window_right} keys right of the query "
                f"(cuDNN's sliding_window_length, behind jax.nn.dot_product_attention's "
                f"local_window_size, covers keys on the left only)")
    if spec.dropout:
        return ("dropout (cuDNN draws its mask from a static seed, not the call's "
                "dropout_rng, so masks would repeat across calls and steps)")
    if spec.kv_valid:
        return ("a boolean kv mask (cuDNN's padding mask is a per-batch prefix length; "
                "an arbitrary or traced mask cannot be expressed, e.g. T not a multiple of "
                "a segment length, kv_mask, ring padding, a decode cache)")
    # A window that ends at its query is causal: cuDNN runs it as its causal mask
    # with a left bound, so it needs what the causal mask needs.
    masked = ("a causal mask" if spec.is_causal else "a sliding window" if spec.window
              else None)
    if masked and spec.positions != "arange":
        return (f"{masked} by position arrays (ring steps / zigzag and striped layouts); "
                f"cuDNN's causal mask and window follow the top-left diagonal of one block")
    if masked and spec.len_q is not None and spec.len_k is not None \
            and spec.len_q != spec.len_k:
        return (f"{masked} with len_q={spec.len_q} != len_k={spec.len_k} (top-left and "
                f"bottom-right diagonals differ; only square blocks are sent to cuDNN)")
    return None


def augmented_backward_reason(info: DeviceInfo, head_dim: int) -> str | None:
    """Why the generic cuDNN backward (head_dim + 8 columns) cannot run, or None."""
    limit = cudnn_max_head_dim(info)
    if head_dim + AUGMENT_COLUMNS > limit:
        return (f"a backward with a log-sum-exp cotangent or a global delta widens the "
                f"head to {head_dim}+{AUGMENT_COLUMNS}, above cuDNN's {limit} on this "
                f"device; that backward runs on the XLA kernel")
    return None
