"""Attention kernels: one class per backend, each a :class:`~.base.Kernel`.

``xla`` (:class:`~.xla.XlaKernel`, blockwise, every platform), ``cudnn``
(:class:`~.cudnn.CudnnKernel`, fused attention on NVIDIA GPUs); :mod:`.registry`
picks one per call at trace time (:class:`~.registry.AutoKernel`),
:mod:`.selection` holds the rules, :mod:`.cudnn_probe` reads what the installed JAX
offers cuDNN.
"""

from jax_dilated.backends.base import NO_MASKS, Kernel, KernelArgs, KernelBase, Masks
from jax_dilated.backends.registry import (
           IMPLEMENTATIONS,
           get_kernel,
           select_implementation,
)
from jax_dilated.backends.report import KernelChoice, backend_report

__all__ = ["Kernel", "KernelArgs", "KernelBase", "Masks", "NO_MASKS", "IMPLEMENTATIONS",
           "get_kernel", "select_implementation", "backend_report", "KernelChoice"]
