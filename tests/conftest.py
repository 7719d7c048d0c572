"""Test configuration shared by the whole suite.

* float64 is enabled so that the parity tests can compare at ~1e-10; tests of
  other dtypes build their arrays with an explicit dtype (see ``_helpers.py``).
* 8 simulated CPU devices, so that ring / distributed tests can build meshes of
  1, 2, 4 and 8 devices (single-device tests use device 0 as usual). Where the
  default backend is an accelerator with fewer devices (one GPU), the tests that
  need more skip (``_mesh.py``), and so do the bounds on compiled memory measured on
  XLA:CPU (``_helpers.XLA_CPU_MEMORY``); float32 matrix products run in full float32
  there, not TF32 (see below).
* ``tests/`` is put on ``sys.path`` so ``torch_reference`` and ``_helpers``
  import the same way however pytest was invoked (and the repository root, for
  ``benchmarks``).
* A FutureWarning or DeprecationWarning that our code causes is an error (see
  ``_fail_on_our_warnings``); ``pytest.warns`` still catches the deliberate ones.
* XLA compiles the generated CPU code without LLVM's optimisations
  (``--xla_backend_optimization_level=0``, unless ``XLA_FLAGS`` already sets a
  level): the suite compiles thousands of small programs and runs each once or
  twice, so those optimisations cost more time than they save (about a fifth of a
  module's time). They change how fast the code runs, not what the XLA program
  computes; the subprocesses that tests start inherit the setting.
* Where XLA:CPU still has its older fusion code generator (jax 0.10; gone by 0.12,
  where the flag would abort the process, hence the probe below), the tests use it
  (``--xla_cpu_use_fusion_emitters=false``): it compiles these programs in less than
  half the time of the newer emitters (test_strategies.py: 18.6 against 42.4 s of
  compilation, 40 against 65 s in all, on the 2-core CI machine kind), and it
  generates code for the same XLA program, which the parity tests check as before.
* XLA compiles each program's machine code in one piece
  (``--xla_cpu_parallel_codegen_split_count=1``; by default it cuts the code into up
  to 32 pieces compiled on several threads): with a test worker per core there are
  no idle cores to compile them on, and the cutting costs time (test_ring.py with one
  test_documents case, one process on the 2-core CI machine kind: about 7% faster in
  two interleaved pairs). It changes how the code is compiled, not what the XLA
  program computes.
* On a GPU, XLA's reductions are made bitwise repeatable
  (``--xla_gpu_deterministic_ops=true``; the CPU ignores it): the training tests
  compare a resumed run with an uninterrupted one bit for bit, and on an H100 two
  fresh runs differed in the 8th digit without it (not yet re-run there with it).
"""

import contextlib
import os
import subprocess
import sys
import warnings


def _add_xla_flag(flag, value):
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = " ".join(
            filter(None, [os.environ.get("XLA_FLAGS"), f"--{flag}={value}"]))


def _xla_knows(flag, value):
    """Whether this jaxlib's XLA accepts ``--flag=value``: an unknown flag aborts the
    process that parses it, so a child process is asked (once per test run: the
    answer is left in ``JD_TEST_LEGACY_EMITTERS``, which the workers and subprocesses
    inherit)."""
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    env = dict(os.environ, XLA_FLAGS=f"--{flag}={value}", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", probe], env=env,
                          capture_output=True).returncode == 0


_add_xla_flag("xla_backend_optimization_level", "0")
_add_xla_flag("xla_gpu_deterministic_ops", "true")
_add_xla_flag("xla_cpu_parallel_codegen_split_count", "1")
if os.environ.get("JD_TEST_LEGACY_EMITTERS") is None:
    os.environ["JD_TEST_LEGACY_EMITTERS"] = str(
        int(_xla_knows("xla_cpu_use_fusion_emitters", "false")))
if os.environ["JD_TEST_LEGACY_EMITTERS"] == "1":
    _add_xla_flag("xla_cpu_use_fusion_emitters", "false")

import jax  # (after XLA_FLAGS is set)
import pytest

import jax_dilated

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_num_cpu_devices", 8)

# On an NVIDIA GPU, JAX's default precision for float32 matrix products is TF32, a
# hardware mode with about 1e-3 relative error; the float32 parity tests check the
# algorithm at float32's own rounding (1e-5), so there products run in full float32.
# Users choose TF32 (or not) with ``precision=`` or this same flag; on CPU nothing changes.
if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
# the repository root too, for the `benchmarks` package (harness helpers, baselines)
# when pytest is started by its own script rather than `python -m pytest`
_ROOT = os.path.dirname(_TESTS)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

try:
    import torch  # noqa: F401
except ImportError:
    # Without PyTorch (it is pinned for Python 3.11 only) the modules built on the
    # PyTorch references cannot be imported; the others still run.
    collect_ignore = ["test_parity.py", "test_kernel.py", "test_softmax.py",
                      "test_backends.py", "test_extreme_logits.py"]


# ------------------------------------------------- warnings caused by our code fail
#
# pyproject's ``filterwarnings`` makes the warnings *issued* by jax_dilated errors, but
# a filter only sees the module of the warning's ``stacklevel`` frame: JAX issues its
# FutureWarnings (e.g. "scatter inputs have incompatible types ... will result in an
# error") and its deprecations from its own modules even when our call caused them.
# So the stack is inspected when such a warning is shown: the innermost frames belong
# to the package that issued it; the first frame outside that package is the caller
# that caused it. If that caller, the issuing frame or the stacklevel frame is ours
# (jax_dilated/ or tests/), the warning is raised (the test fails there, as under
# ``-W error``) instead of recorded. A warning that a third party causes inside its
# own code (flax calling a deprecated JAX function) is only recorded. Inside
# ``pytest.warns`` / ``pytest.deprecated_call`` warnings are recorded by them and
# never reach this hook, so the deliberate ones keep working.

_OURS = (os.path.dirname(os.path.abspath(jax_dilated.__file__)) + os.sep, _TESTS + os.sep)
_STRICT = (FutureWarning, DeprecationWarning)


def _package(frame) -> str:
    top = (frame.f_globals.get("__name__") or "").partition(".")[0]
    return "jax" if top == "jaxlib" else top


def _ours(filename) -> bool:
    return bool(filename) and os.path.abspath(filename).startswith(_OURS)


def _culprit(filename, frame):
    """``file:line`` of ours that caused the warning, or None.

    ``filename``: the warning's stacklevel frame; ``frame``: the frame that called
    ``showwarning`` (the ``warnings`` machinery, then the issuer)."""
    if _ours(filename):
        return filename
    while frame is not None and _package(frame) == "warnings":
        frame = frame.f_back
    issuer = None if frame is None else _package(frame)
    while frame is not None:
        if _ours(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if _package(frame) != issuer:   # a third party called the issuer: not ours
            return None
        frame = frame.f_back
    return None


@contextlib.contextmanager
def _our_warnings_fail():
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        __tracebackhide__ = True
        if issubclass(category, _STRICT):
            where = _culprit(filename, sys._getframe(1))
            if where is not None:
                if not isinstance(message, Warning):
                    message = category(message)
                message.add_note(f"caused by {where}: tests/conftest.py turns "
                                 f"{category.__name__}s caused by our code into errors")
                raise message
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield
    finally:
        warnings.showwarning = shown


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _our_warnings_fail():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _our_warnings_fail():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _our_warnings_fail():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    with _our_warnings_fail():   # module-level code of the test files
        return (yield)


# ------------------------------------- the default kernel as an NVIDIA GPU chooses it
#
# On a GPU, implementation=None is the cuDNN kernel (calls it cannot serve, float64
# among them, go to the XLA kernel one by one), which is neither blockwise nor fused:
# the one-device program is then "batched" or the non-blockwise "streamed"
# (ops/dilated_programs.choose_program), paths a CPU never takes by itself. A test
# that takes this fixture runs twice: with this machine's default kernel, and with
# the default that a (described) H100 gets, cuDNN's wrapper around its pure-JAX
# stand-in primitive (backends/cudnn_reference.py).


@pytest.fixture(params=["default", "cudnn-reference"])
def default_kernel(request, monkeypatch):
    """The name of the default kernel in force: "default" (this machine's) or
    "cudnn-reference" (a described H100's, around the stand-in primitive)."""
    if request.param == "cudnn-reference":
        from jax_dilated.backends import cudnn, registry, selection

        h100 = selection.DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", (9, 0), "cuda")
        auto = registry.AutoKernel(cudnn.CudnnKernel(ops=cudnn.ReferenceOps(), device=h100))
        chosen = registry.select_implementation
        monkeypatch.setattr(registry, "select_implementation", lambda impl, **kw: (
            "cudnn" if impl is None else chosen(impl, **kw)))
        monkeypatch.setattr(registry, "_auto_for", lambda device: auto)
    return request.param


@pytest.fixture(scope="module")
def torch_on_one_thread():
    """PyTorch on one intra-op thread while a module that asks for it runs (restored
    after): those modules' references are float64 PyTorch at a thousand tokens or more,
    and with two threads on a 2-core machine running a test worker per core (CI) the
    threads spin against the other worker (the torchscale reference at 1069 tokens:
    1.7-10 s of CPU on two threads, 0.6 s on one). Without PyTorch it does nothing
    (the tests that need it skip)."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
