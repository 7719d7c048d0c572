"""Compile the native CPU kernel on first use, cache it, and register it with XLA.

The kernel (``attention_cpu.cc``) is C++ against XLA's FFI headers, which ship with
``jaxlib`` (``jax.ffi.include_dir()``), so it is compiled on the user's machine, for
its CPU (``-march=native``) and its jaxlib, by the system's C++ compiler (``$CXX``,
else ``c++``). The shared library is cached under ``$JAX_DILATED_CACHE`` (default
``$XDG_CACHE_HOME/jax_dilated`` or ``~/.cache/jax_dilated``), named by a hash of the
source, the compiler, the flags, jaxlib's version and the CPU, so a later process
loads it in milliseconds. Where it cannot be built (no compiler, no AVX-512, not
Linux on x86-64) :func:`load` says why and the XLA kernel serves every call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

SOURCE = pathlib.Path(__file__).with_name("attention_cpu.cc")
# the FFI targets' names in XLA and their handlers' symbols in the library
TARGET = "jax_dilated_attention_forward_cpu"
TARGET_DILATED = "jax_dilated_dilated_attention_forward_cpu"
TARGET_DILATED_BACKWARD = "jax_dilated_dilated_attention_backward_cpu"
_SYMBOLS = {TARGET: "JaxDilatedAttentionForwardCpu",
            TARGET_DILATED: "JaxDilatedAttentionDilatedForwardCpu",
            TARGET_DILATED_BACKWARD: "JaxDilatedAttentionDilatedBackwardCpu"}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")


@functools.lru_cache(maxsize=None)
def load() -> str | None:
    """Build (or find in the cache), load and register the kernel once per process.

    Returns None when the kernel is registered, else why it cannot run here (the
    calls then go to the XLA kernel; ``jd.backend_report()`` prints the reason).
    """
    reason = _platform_reason()
    if reason:
        return reason
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found) to build it"
    try:
        library = _build(compiler)
        lib = ctypes.cdll.LoadLibrary(str(library))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        return f"it did not build or load ({type(err).__name__}: {_first_line(err)})"
    return None


def _platform_reason() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs Linux on x86-64 (this is {platform.system()} {platform.machine()})"
    flags = _cpu_flags()
    if "avx512f" not in flags:
        return "it needs a CPU with AVX-512 (this CPU has no avx512f)"
    return None


def _cpu_flags() -> set[str]:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> pathlib.Path:
    given = os.environ.get("JAX_DILATED_CACHE")
    if given:
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jax_dilated"


def _build(compiler: str) -> pathlib.Path:
    """The cached library for this source, compiler, jaxlib and CPU; compiled if absent
    (into a temporary file renamed into place, so that concurrent processes agree)."""
    import jaxlib

    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), " ".join(_FLAGS).encode(),
                 jaxlib.__version__.encode(), " ".join(sorted(_cpu_flags())).encode(),
                 platform.processor().encode()):
        key.update(part + b"\0")
    cache = _cache_dir()
    library = cache / f"attention_cpu-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        run = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-500:]}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
