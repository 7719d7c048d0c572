"""Which kernel runs where: chosen at trace time from the device kind and the call.

* ``implementation=None`` (the default everywhere): on a device that can run
  cuDNN fused attention (an NVIDIA GPU with compute capability >= 8.0 and a JAX
  built with cuDNN) every kernel call goes to cuDNN when the call is one cuDNN
  serves (dtype, head_dim, mask kind; :mod:`.selection`) and to the blockwise XLA
  kernel otherwise. The choice is made per call *while tracing*, from static
  shapes, dtypes and which masks are present - never by catching errors at run
  time. On a CPU where the native kernel builds (:mod:`.native`: Linux on x86-64 with
  AVX2 and FMA, or on aarch64, and a C++ compiler) the calls it serves run it, the
  others the XLA kernel. On every other device (TPU, older or non-NVIDIA GPUs, CPUs without the
  native kernel) it is the XLA kernel.
* ``implementation="xla"``: the blockwise XLA kernel everywhere.
* ``implementation="native"``: the native CPU kernel where it serves a call (the
  XLA kernel for the rest), or a ``ValueError`` saying why it cannot run here.
* ``implementation="cudnn"``: cuDNN or a ``ValueError`` saying why not - at
  selection time for the device (not a capable GPU, JAX without cuDNN) and at
  trace time for a call (e.g. float32, a kv mask, causal ring steps).

:func:`get_kernel` keeps its old form (``get_kernel(implementation)``); the
optional ``device=`` and hints (``dtype=``, ``head_dim=``) make an explicit
request fail early, when a layer is built or a function traced.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import get_args

import jax

from jax_dilated.backends import call_specs, cudnn, native, selection, xla
from jax_dilated.backends.base import NO_MASKS, Kernel, KernelBase, Masks
from jax_dilated.core.types import Implementation

__all__ = ["IMPLEMENTATIONS", "get_kernel", "select_implementation", "AutoKernel",
           "explain_call", "device_choice", "DeviceChoice"]

IMPLEMENTATIONS = get_args(Implementation)  # ("xla", "cudnn", "native")


def _check_name(implementation) -> None:
    if implementation is not None and (not isinstance(implementation, str)
                                       or implementation not in IMPLEMENTATIONS):
        raise ValueError(
            f"implementation must be None (choose by device kind) or one of "
            f"{IMPLEMENTATIONS}, got {implementation!r}."
        )


def _hint_reason(info: selection.DeviceInfo, dtype, head_dim) -> str | None:
    """A call-level reason knowable from hints alone (dtype, head_dim), or None."""
    if dtype is None and head_dim is None:
        return None
    spec = selection.CallSpec(
        dtype=jax.numpy.dtype(dtype).name if dtype is not None else "bfloat16",
        head_dim=head_dim if head_dim is not None else 64)
    return selection.cudnn_call_reason(info, spec)


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """The kernel a device gives a request, and why: the one statement of the
    CPU / GPU decision tree, read by :func:`select_implementation` (what runs) and
    :func:`explain_call` (what :func:`jax_dilated.backend_report` prints).

    kernel: ``"xla"``, ``"cudnn"`` or ``"native"``.
    why_not: None when the device runs the kernel asked for (or, for
      ``implementation=None``, its best one); else why the XLA kernel serves instead,
      or, for an explicit name, why it cannot run here (:func:`select_implementation`
      raises it).
    """

    kernel: str
    why_not: str | None = None


def device_choice(implementation: str | None, info: selection.DeviceInfo,
                  software_reason: str | None = "detect") -> DeviceChoice:
    """Which kernel ``info``'s device runs for ``implementation`` (None: by device
    kind): the native kernel on a CPU where it builds, cuDNN on a device that can run
    it, the XLA kernel elsewhere. Calls a chosen kernel cannot serve still go to the
    XLA kernel, one by one (``selection.native_call_reason``,
    ``selection.cudnn_call_reason``)."""
    if implementation == "xla":
        return DeviceChoice("xla")
    if implementation == "native" or (implementation is None and info.platform == "cpu"):
        reason = native_reason(info)
        if reason is None or implementation == "native":
            return DeviceChoice("native", reason)
        return DeviceChoice("xla", f"no native CPU kernel: {reason}")
    reason = selection.cudnn_device_reason(info, software_reason)
    if implementation is None and reason:
        return DeviceChoice("xla", "no cuDNN on this device")
    return DeviceChoice("cudnn", reason)


def select_implementation(implementation: Implementation | None, *, device=None, dtype=None,
                          head_dim: int | None = None,
                          software_reason: str | None = "detect") -> str:
    """Resolve ``implementation`` (None = by device kind) to a registered name.

    Returns ``"cudnn"`` for None on a device that can run cuDNN (calls cuDNN
    cannot serve still go to the XLA kernel, per call), ``"native"`` on a CPU where
    the native kernel builds (likewise per call), else ``"xla"``.

    Args:
      implementation: None, ``"xla"``, ``"cudnn"`` or ``"native"``.
      device: a ``jax.Device`` or anything with ``platform``/``device_kind``/
        ``compute_capability`` (default ``jax.devices()[0]``).
      dtype, head_dim: optional hints; with ``implementation="cudnn"`` a hint cuDNN
        cannot serve raises now.
      software_reason: ``"detect"`` (check the installed JAX) or, for described
        machines, None / a reason string.

    Raises:
      ValueError: an unknown name, or ``"cudnn"`` where it cannot run (says why).
    """
    _check_name(implementation)
    if implementation == "xla":
        return "xla"
    info = selection.describe_device(device if device is not None else jax.devices()[0])
    choice = device_choice(implementation, info, software_reason)
    if implementation is None:
        return choice.kernel
    if choice.why_not:
        raise ValueError(f"implementation={implementation!r} cannot run here: "
                         f"{choice.why_not}. Use implementation=None or 'xla'.")
    if implementation == "native":
        return "native"
    hint = _hint_reason(info, dtype, head_dim)
    if hint:
        raise ValueError(f"implementation='cudnn' cannot serve this call: {hint}. "
                         f"Use implementation=None or 'xla'.")
    return "cudnn"


def native_reason(info: selection.DeviceInfo) -> str | None:
    """None when the native CPU kernel can run on ``info``'s device, else why not."""
    if info.platform != "cpu":
        return f"it runs on CPUs only (this device is {info.platform})"
    return native.unavailable_reason()


class AutoKernel(KernelBase):
    """cuDNN where a call can use it, the XLA kernel elsewhere (decided per call at trace time).

    A :class:`~.base.Kernel`: ``forward``/``backward``/``attention`` go to cuDNN or
    XLA per call (``choose``); the block-sparse entry points and
    ``block_sparse_ring_steps`` always go to the XLA kernel (cuDNN has none);
    ``ring_steps`` gives the XLA kernel's steps only where cuDNN cannot serve the
    ring's calls.
    """

    name = "auto"

    def __init__(self, cudnn_kernel: cudnn.CudnnKernel,
                 xla_kernel: xla.XlaKernel | None = None):
        self.cudnn = cudnn_kernel
        self.xla = xla.KERNEL if xla_kernel is None else xla_kernel

    def choose(self, q, k, args, masks: Masks = NO_MASKS):
        """``(kernel, why not cuDNN)``: the cuDNN kernel and None, or the XLA kernel and
        the reason cuDNN cannot serve this call (segment ids, for one)."""
        reason = self.cudnn.call_reason(q, k, args, masks)
        return (self.xla, reason) if reason else (self.cudnn, None)

    def forward(self, q, k, v, args, masks: Masks = NO_MASKS):
        kernel, _ = self.choose(q, k, args, masks)
        return kernel.forward(q, k, v, args, masks)

    def backward(self, q, k, v, do, lse, delta, args, masks: Masks = NO_MASKS, *, out=None):
        kernel, _ = self.choose(q, k, args, masks)
        return kernel.backward(q, k, v, do, lse, delta, args, masks, out=out)

    def attention(self, q, k, v, args, masks: Masks = NO_MASKS, *, sinks=None,
                  lse_grad=True):
        kernel, _ = self.choose(q, k, args, masks)
        return kernel.attention(q, k, v, args, masks, sinks=sinks, lse_grad=lse_grad)

    def batch_chunk(self, n, q, k, args):
        """That of the kernel a call shaped like ``q``/``k`` goes to."""
        kernel, _ = self.choose(q, k, args)
        return kernel.batch_chunk(n, q, k, args)

    def block_sparse_forward(self, q, k, v, args, masks: Masks = NO_MASKS, *, blocks):
        """The XLA kernel's (cuDNN has no block-sparse kernel)."""
        return self.xla.block_sparse_forward(q, k, v, args, masks, blocks=blocks)

    def block_sparse_backward(self, q, k, v, do, lse, delta, args, masks: Masks = NO_MASKS,
                              *, blocks):
        """The XLA kernel's (cuDNN has no block-sparse kernel)."""
        return self.xla.block_sparse_backward(q, k, v, do, lse, delta, args, masks,
                                              blocks=blocks)

    def ring_steps(self, q, k, args):
        """The XLA kernel's fused ring steps, or None where cuDNN can serve a ring step
        (non-causal and no window: positions do not matter), so that the ring calls
        ``forward``/``backward`` per step and gets cuDNN."""
        spec = call_specs.call_spec(q, k, args, q_positions=None, k_positions=None)
        if args.is_causal or args.window is not None:  # steps pass traced positions
            spec = dataclasses.replace(spec, positions="arbitrary")
        if selection.cudnn_call_reason(self.cudnn.info, spec) is None:
            return None
        return self.xla.ring_steps(q, k, args)

    def block_sparse_ring_steps(self, q, k, args):
        """The XLA kernel's (block-sparse calls always run there)."""
        return self.xla.block_sparse_ring_steps(q, k, args)


@functools.lru_cache(maxsize=None)
def _auto_for(device) -> AutoKernel:
    return AutoKernel(cudnn.CudnnKernel(device=device))


@functools.lru_cache(maxsize=None)
def _cudnn_for(device) -> cudnn.CudnnKernel:
    return cudnn.CudnnKernel(device=device)


def get_kernel(implementation: Implementation | None, *, device=None, dtype=None,
               head_dim: int | None = None) -> Kernel:
    """The kernel to use: an instance of a :class:`~.base.Kernel` class.

    ``None``: an :class:`AutoKernel` (per-call cuDNN or XLA) on devices with cuDNN,
    the native CPU kernel (:data:`.native.KERNEL`, per call native or XLA) on CPUs
    where it builds, else the XLA kernel (:data:`.xla.KERNEL`). ``"xla"``: the XLA
    kernel. ``"cudnn"``, ``"native"``: that kernel, or ``ValueError``.
    """
    device = device if device is not None else jax.devices()[0]
    name = select_implementation(implementation, device=device, dtype=dtype,
                                 head_dim=head_dim)
    if name == "xla":
        return xla.KERNEL
    if name == "native":
        return native.KERNEL
    if implementation is None:
        return _auto_for(device)
    return _cudnn_for(device)


def explain_call(info, spec: selection.CallSpec, *, software_reason="detect",
                 lse_cotangent: bool = False) -> tuple[str, str]:
    """``(kernel, why)`` for a call described by ``spec`` on device ``info`` (implementation=None).

    ``lse_cotangent``: whether the backward of this call receives a cotangent on
    its log-sum-exp (branch merges), which needs the augmented cuDNN backward.
    """
    info = selection.describe_device(info)
    choice = device_choice(None, info, software_reason)
    if choice.kernel == "xla":
        return "xla", f"blockwise XLA kernel ({choice.why_not})"
    if choice.kernel == "native":
        reason = selection.native_call_reason(spec)
        if reason:
            return "xla", f"the native CPU kernel cannot serve {reason}"
        return "native", ("compiled forward (online softmax fused in registers); the XLA "
                          "kernel's backward from its lse")
    call_reason = selection.cudnn_call_reason(info, spec)
    if call_reason:
        return "xla", f"cuDNN cannot serve {call_reason}"
    limit = selection.cudnn_max_head_dim(info)
    if lse_cotangent:
        aug = selection.augmented_backward_reason(info, spec.head_dim)
        back = ("backward on cuDNN with the head widened by 8 columns to carry "
                "delta - dlse" if aug is None else f"backward on XLA: {aug}")
        return "cudnn", f"fused forward (float32 lse); {back}"
    return "cudnn", (f"fused forward and backward ({spec.dtype}, head_dim "
                     f"{spec.head_dim} <= {limit})")

