"""Attention kernels, one module per backend, all with the interface of :mod:`.base`."""

from jax_dilated.backends.base import KernelArgs
from jax_dilated.backends.registry import IMPLEMENTATIONS, get_kernel, select_implementation

__all__ = ["KernelArgs", "IMPLEMENTATIONS", "get_kernel", "select_implementation"]
