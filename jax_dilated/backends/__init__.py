"""Attention kernels, one module per backend, all with the interface of :mod:`.base`.

``xla`` (blockwise, every platform), ``cudnn`` (fused attention on NVIDIA GPUs);
:mod:`.registry` picks one per call at trace time, :mod:`.selection` holds the rules.
"""

from jax_dilated.backends.base import KernelArgs
from jax_dilated.backends.registry import (
           IMPLEMENTATIONS,
           get_kernel,
           select_implementation,
)
from jax_dilated.backends.report import KernelChoice, backend_report

__all__ = ["KernelArgs", "IMPLEMENTATIONS", "get_kernel", "select_implementation",
           "backend_report", "KernelChoice"]
