"""Test configuration shared by the whole suite.

* float64 is enabled so that the parity tests can compare at ~1e-10; tests of
  other dtypes build their arrays with an explicit dtype (see ``_helpers.py``).
* 8 simulated CPU devices, so that ring / distributed tests can build meshes of
  1, 2, 4 and 8 devices (single-device tests use device 0 as usual).
* ``tests/`` is put on ``sys.path`` so ``torch_reference`` and ``_helpers``
  import the same way however pytest was invoked.
"""

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_num_cpu_devices", 8)

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

try:
    import torch  # noqa: F401
except ImportError:
    # Without PyTorch (it is pinned for Python 3.11 only) the modules built on the
    # PyTorch references cannot be imported; the others still run.
    collect_ignore = ["test_parity.py", "test_kernel.py", "test_softmax.py",
                      "test_backends.py"]
