"""Ring, dilated and block-sparse attention (every strategy) across real processes: ``scripts/multiprocess.py``, 2 processes x 2 CPU devices.

The script starts its own processes (``jax.distributed`` over gloo on 127.0.0.1),
so it runs in a subprocess here, unaffected by this process's simulated devices
and float64 setting. The test skips only when the installed jax/jaxlib has no
``jax.distributed`` or no gloo CPU collectives.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "multiprocess.py")

_PROBE = """
import jax
from jax._src.lib import _jax
assert hasattr(jax.distributed, "initialize"), "jax.distributed.initialize is missing"
assert hasattr(_jax, "make_gloo_tcp_collectives"), "jaxlib was built without gloo"
jax.config.update("jax_cpu_collectives_implementation", "gloo")
"""


def _env():
    # the suite's XLA_FLAGS (tests/conftest.py: fast compilation; CI's instruction set)
    # reach the workers, less a forced host device count (scripts/multiprocess.py)
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def gloo_available():
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=_env(), capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("jax.distributed with gloo CPU collectives is unavailable in the "
                    f"installed jax/jaxlib: {probe.stderr.strip().splitlines()[-1:]}")


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, SCRIPT, *args], env=_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_ring_two_processes_two_devices(gloo_available):
    proc = _run("--num-processes", "2", "--devices-per-process", "2",
                "--tokens-per-device", "6", "--timeout", "150")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "mesh {'data': 1, 'seq': 4}" in out, out
    for layout in ("contiguous", "zigzag", "striped"):
        assert f"PASS layout={layout} " in out, out
    assert "FAIL" not in out, out
    assert "ALL PASS (2 processes)" in out, out


def test_dilated_two_processes_two_devices(gloo_available):
    """Segments 16 and 32 span 2 and 4 devices: their dilated rings cross processes."""
    proc = _run("--op", "dilated", "--segments", "4,8,16,32", "--rates", "1,2,4,8",
                "--tokens-per-device", "8", "--timeout", "150")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "mesh {'data': 1, 'seq': 4}" in out, out
    assert "PASS dilated segments=[4, 8, 16, 32] rates=[1, 2, 4, 8]" in out, out
    assert "FAIL" not in out, out
    assert "ALL PASS (2 processes)" in out, out


def test_failure_is_reported_with_nonzero_exit(gloo_available):
    """A tolerance nothing can meet must fail loudly, in the output and the exit code."""
    proc = _run("--layouts", "contiguous", "--tol", "0", "--timeout", "150")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "FAIL layout=contiguous" in out, out


def test_strategies_two_processes_two_devices(gloo_available):
    """allgather and heads (ring: the tests above) for exact, dilated and block-sparse
    attention, in one launch: their all-gathers, all-to-alls and (dilated segments of 2
    devices) in-group gathers cross the processes; and dilated attention with one
    strategy per branch (the branch of 16 exchanges heads inside each process's pair
    of devices, the branch of 32 across all four)."""
    proc = _run("--op", "all", "--strategies", "allgather,heads,ring+heads+heads",
                "--layouts", "zigzag",
                "--segments", "4,16,32", "--rates", "1,2,4", "--tokens-per-device", "8",
                "--timeout", "200")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for strategy in ("allgather", "heads"):
        assert f"PASS layout=zigzag strategy={strategy} " in out, out
        assert (f"PASS dilated segments=[4, 16, 32] rates=[1, 2, 4] mode=longnet "
                f"strategy={strategy} ") in out, out
        assert f"PASS block_sparse block_size=4 strategy={strategy} " in out, out
    assert ("PASS dilated segments=[4, 16, 32] rates=[1, 2, 4] mode=longnet "
            "strategy=ring+heads+heads ") in out, out
    assert "FAIL" not in out, out
    assert "ALL PASS (2 processes)" in out, out
