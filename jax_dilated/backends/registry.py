"""Which kernel runs where: chosen once, at trace time, from the device kind.

Only the blockwise XLA kernel exists so far; it runs on every platform. The
selection lives here so that adding a backend changes one table, not callers.
"""

from __future__ import annotations

import types

import jax

from jax_dilated.backends import xla

__all__ = ["IMPLEMENTATIONS", "get_kernel", "select_implementation"]

_KERNELS = {"xla": xla}
IMPLEMENTATIONS = tuple(_KERNELS)


def select_implementation(implementation: str | None, *, device=None) -> str:
    """Resolve ``implementation`` (None = by device kind) to a registered name.

    Raises:
      ValueError: for a name that is not a known implementation.
    """
    if implementation is None:
        # Every platform gets the blockwise XLA kernel until a device-specific
        # kernel is registered for it.
        del device
        return "xla"
    if not isinstance(implementation, str) or implementation not in _KERNELS:
        raise ValueError(
            f"implementation must be None (choose by device kind) or one of "
            f"{IMPLEMENTATIONS}, got {implementation!r}."
        )
    return implementation


def get_kernel(implementation: str | None, *, device=None) -> types.ModuleType:
    """The kernel module (with ``forward``, ``backward``, ``attention``) to use."""
    return _KERNELS[select_implementation(implementation, device=device or jax.devices()[0])]
