"""Compile the native CPU kernel on first use, cache it, and register it with XLA.

The kernel (``attention_cpu.cc``, with ``gemm_cpu.cc``: the dense products' calls into a
BLAS, :mod:`.gemm`; and the header ``parallel_units.h`` they share) is C++ against
XLA's FFI headers, which ship with ``jaxlib`` (``jax.ffi.include_dir()``), so it is
compiled on the user's machine, for its CPU and its jaxlib, by the system's C++
compiler (``$CXX``, else ``c++``). One source serves these instruction sets, chosen
for the machine:

- ``amx``: x86-64 CPUs with AMX-BF16 (Intel Sapphire Rapids and later): as
  ``avx512_bf16``, with the products of the forward and the fused backward on
  bfloat16 inputs on the tile unit (where Linux grants the process its tile
  registers; else as ``avx512_bf16``);
- ``avx512_bf16``: x86-64 CPUs with AVX-512 and AVX512-BF16 (AMD Zen 4 and later,
  Intel Cooper Lake, Sapphire Rapids and later; ``-march=native``): bfloat16 inputs
  are multiplied as bfloat16 pairs by ``vdpbf16ps`` into float32 (the forward and
  the fused backward), where the other builds convert them to float32 first;
- ``avx512``: x86-64 CPUs with AVX-512 (``-march=native``, without AVX512-BF16);
- ``avx2``: x86-64 CPUs with AVX2, FMA and F16C and no AVX-512 (``-mavx2 -mfma
  -mf16c``, tuned for the machine);
- ``neon``: aarch64 (``-mcpu=native``).

``JAX_DILATED_NATIVE_ISA=avx2`` forces the AVX2 build on a CPU with AVX-512 (AVX2
code runs there), so that build is tested and measured on any x86-64 machine;
``avx512_bf16`` forces the build without AMX, ``avx512`` the AVX-512 build without
the bfloat16 products; ``amx`` and ``neon`` may be named too, and every build is
refused where the CPU lacks its instructions. Two test builds, never chosen by
themselves (:data:`EMULATED`, :data:`EMULATED_AMX`), are the AVX2 build with the
bfloat16 pair path of ``avx512_bf16`` (each pair's products computed by FMAs), and
with the tile path of ``amx`` too (each tile instruction computed by loops): they test
those paths' data layouts on any x86-64 CPU.
The shared library is cached under ``$JAX_DILATED_CACHE`` (default
``$XDG_CACHE_HOME/jax_dilated`` or ``~/.cache/jax_dilated``), named by the
instruction set and a hash of the source, the compiler, the flags, jaxlib's version
and the CPU, so a later process loads it in milliseconds (processes that start
together, such as the processes of one host, compile it once). Where it cannot be built
(no compiler, not Linux on x86-64 with AVX2 or aarch64) :func:`load` says why and
the XLA kernel serves every call.

Each build registers its FFI targets under names of its own (:func:`target`), so
builds can live side by side in one process: a program compiled under one keeps
calling it. :func:`using` switches builds for the programs traced inside it (tests
of every instruction set, benchmarks of one kernel version against another).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

import jax

SOURCE = pathlib.Path(__file__).with_name("attention_cpu.cc")
# compiled into every build beside the kernel's source: the dense products' call into a
# BLAS GEMM (jax_dilated/backends/native/gemm.py)
GEMM_SOURCE = pathlib.Path(__file__).with_name("gemm_cpu.cc")
# the header both include (found by -I this directory, also for a `using` source)
HEADER = pathlib.Path(__file__).with_name("parallel_units.h")
# the FFI calls (the stem of their targets' names in XLA) and their handlers' symbols
TARGET = "jax_dilated_attention_forward_cpu"
TARGET_DILATED = "jax_dilated_dilated_attention_forward_cpu"
TARGET_DILATED_BACKWARD = "jax_dilated_dilated_attention_backward_cpu"
TARGET_GEMM = "jax_dilated_gemm_cpu"
TARGET_GEMM_BF16 = "jax_dilated_gemm_bf16_cpu"
TARGET_GEMM_GELU_NORM = "jax_dilated_gemm_gelu_norm_cpu"
_SYMBOLS = {TARGET: "JaxDilatedAttentionForwardCpu",
            TARGET_DILATED: "JaxDilatedAttentionDilatedForwardCpu",
            TARGET_DILATED_BACKWARD: "JaxDilatedAttentionDilatedBackwardCpu",
            TARGET_GEMM: "JaxDilatedGemmCpu", TARGET_GEMM_BF16: "JaxDilatedGemmBf16Cpu",
            TARGET_GEMM_GELU_NORM: "JaxDilatedGemmGeluNormCpu"}
# the symbol naming the instruction set the library was compiled for
_ISA_SYMBOL = "JaxDilatedNativeIsa"
# the symbol of the library's self-test (0: its bfloat16 path computes attention and
# its gradients)
_SELF_TEST_SYMBOL = "JaxDilatedSelfTest"

ISA_ENV = "JAX_DILATED_NATIVE_ISA"
ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "neon")
# the test builds of the bfloat16 pair path and of the tile path (not among the
# machine's choices)
EMULATED = "avx2_bf16emu"
EMULATED_AMX = "avx2_amxemu"
TEST_BUILDS = (EMULATED, EMULATED_AMX)
ISA_NAMES = {"amx": "AVX-512 with AVX512-BF16 and AMX-BF16 (bfloat16 tiles)",
             "avx512_bf16": "AVX-512 with AVX512-BF16 (bfloat16 dot products)",
             "avx512": "AVX-512", "avx2": "AVX2+FMA", "neon": "NEON",
             EMULATED: "AVX2+FMA, bfloat16 dot products emulated",
             EMULATED_AMX: "AVX2+FMA, bfloat16 dot products and AMX tiles emulated"}
# builds whose bfloat16 products no other build checks where they are built: each is
# self-tested once (_self_test) before use
SELF_TESTED = ("amx", "avx512_bf16", EMULATED, EMULATED_AMX)
# the build below each x86-64 one: the machine's choice falls back to it where a build
# cannot be used (AVX2 code runs on every AVX-512 CPU)
FALLBACK = {"amx": "avx512_bf16", "avx512_bf16": "avx512", "avx512": "avx2"}
_X86_64 = ("x86_64", "AMD64")
_AARCH64 = ("aarch64", "arm64")
# what each x86-64 build needs in /proc/cpuinfo's flags
_AVX2_NEEDS = ("avx2", "fma", "f16c")
_X86_NEEDS = {"amx": ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile"),
              "avx512_bf16": ("avx512f", "avx512_bf16"), "avx512": ("avx512f",),
              "avx2": _AVX2_NEEDS, EMULATED: _AVX2_NEEDS, EMULATED_AMX: _AVX2_NEEDS}
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mtune=native")
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
_ISA_FLAGS = {"amx": ("-march=native", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
              "avx512_bf16": ("-march=native", "-mavx512bf16", *_NO_AMX),
              "avx512": ("-march=native", "-mno-avx512bf16", *_NO_AMX),
              # no -march=native: it would turn on AVX-512 where the CPU has it
              "avx2": _AVX2_FLAGS,
              EMULATED: (*_AVX2_FLAGS, "-DJD_BF16_DOT_EMULATED"),
              EMULATED_AMX: (*_AVX2_FLAGS, "-DJD_BF16_DOT_EMULATED", "-DJD_AMX_EMULATED"),
              "neon": ("-mcpu=native",)}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")


@dataclasses.dataclass(frozen=True)
class Library:
    """A built and registered kernel: its instruction set and its FFI targets' names."""

    isa: str
    path: pathlib.Path
    targets: dict
    handle: ctypes.CDLL


# the builds `using` selects, innermost last: (isa or None, source path or None)
_override: list[tuple[str | None, str | None]] = []
# the libraries registered in this process, by path (two requests can name one library:
# a source path that holds the package's source; XLA takes each target name once)
_registered: dict[pathlib.Path, Library] = {}


def load() -> str | None:
    """Build (or find in the cache), load and register the kernel for the build in use
    (the machine's instruction set, ``$JAX_DILATED_NATIVE_ISA``, or :func:`using`),
    once per process and build.

    Returns None when the kernel is registered, else why it cannot run here (the
    calls then go to the XLA kernel; ``jd.backend_report()`` prints the reason).
    """
    return _load(*_requested())[0]


def library() -> Library | None:
    """The build in use (None where :func:`load` gives a reason)."""
    return _load(*_requested())[1]


def isa() -> str | None:
    """The instruction set of the build in use (one of :data:`ISAS`, or a test build),
    or None where it cannot run."""
    lib = library()
    return None if lib is None else lib.isa


def available_isas() -> tuple[str, ...]:
    """The instruction sets of the builds this machine can run (on an x86-64 CPU with
    AVX-512 and no AVX512-BF16: ``("avx512", "avx2")``), whether or not a compiler is
    at hand. (The test builds are not among them: they are asked for by name.)"""
    return tuple(i for i in ISAS if _choose_isa(i) == i)


def target(call: str) -> str:
    """The registered FFI target of ``call`` (:data:`TARGET`, :data:`TARGET_DILATED`,
    :data:`TARGET_DILATED_BACKWARD`) in the build in use."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native CPU kernel cannot run here: {load()}")
    return lib.targets[call]


@contextlib.contextmanager
def using(isa: str | None = None, source: str | os.PathLike | None = None):
    """Programs traced inside use another build of the kernel: ``isa`` (one of
    :data:`ISAS` or a test build; None: as outside) and ``source`` (a kernel source
    file to build instead of :data:`SOURCE`, e.g. an earlier version's, whose FFI calls
    take the same arguments; None: as outside).

    JAX's caches are cleared on entry and exit, so that nothing traced under one
    build is reused under another; programs already compiled keep their build.
    """
    outer = _requested()
    with traced_with(_override, (isa or outer[0],
                                 str(source) if source is not None else outer[1])):
        yield


@contextlib.contextmanager
def traced_with(stack: list, choice):
    """``choice`` on top of ``stack`` (a module's choices, innermost last) while the
    block runs, JAX's caches cleared on entry and exit: programs traced inside see it,
    nothing traced under one choice is reused under another, and programs already
    compiled keep theirs (:func:`using`, and the dense products'
    :func:`~jax_dilated.backends.native.gemm.using_bf16`)."""
    stack.append(choice)
    jax.clear_caches()
    try:
        yield
    finally:
        stack.pop()
        jax.clear_caches()


def _requested() -> tuple[str | None, str | None]:
    """(isa, source) in use: :func:`using`'s, else ``$JAX_DILATED_NATIVE_ISA`` and the
    package's source (None: the machine's choice, :data:`SOURCE`)."""
    if _override:
        return _override[-1]
    return os.environ.get(ISA_ENV, "").strip().lower() or None, None


# one build and registration at a time: programs traced on several threads (a thread
# pool of jitted calls) would otherwise build the same library and register its
# targets twice
_LOCK = threading.Lock()


def _load(requested_isa: str | None, source: str | None) -> tuple[str | None, Library | None]:
    with _LOCK:
        return _load_once(requested_isa, source)


@functools.lru_cache(maxsize=None)
def _load_once(requested_isa: str | None,
               source: str | None) -> tuple[str | None, Library | None]:
    chosen = _choose_isa(requested_isa)
    if chosen not in (*ISAS, *TEST_BUILDS):
        return chosen, None
    reason, lib = _load_build(chosen, source)
    # the machine's choice: a build that does not compile (an older compiler), load or
    # pass its self-test is passed over for the next one down
    while lib is None and requested_isa is None and chosen in FALLBACK:
        chosen = FALLBACK[chosen]
        reason, lib = _load_build(chosen, source)
    return reason, lib


def _load_build(chosen: str, source: str | None) -> tuple[str | None, Library | None]:
    """Build (or find), self-test where SELF_TESTED, load and register build ``chosen``."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found) to build it", None
    source_path = SOURCE if source is None else pathlib.Path(source)
    try:
        path = _build(compiler, chosen, source_path)
        failed = _self_test(path) if chosen in SELF_TESTED else None
        if failed is not None:
            raise RuntimeError(failed)
        if path in _registered:
            return None, _registered[path]
        lib = ctypes.cdll.LoadLibrary(str(path))
        # (a source from before the symbol existed was an AVX-512 one)
        built_for = (ctypes.CFUNCTYPE(ctypes.c_char_p)((_ISA_SYMBOL, lib))().decode()
                     if hasattr(lib, _ISA_SYMBOL) else chosen)
        if built_for != chosen:
            raise RuntimeError(f"built for {built_for}, not {chosen}")
        # names of this build's own: another build registers its calls beside them
        tag = path.stem.split("-", 1)[1].replace("-", "_")
        targets = {call: f"{call}_{tag}" for call in _SYMBOLS}
        for call, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(targets[call], jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        return f"it did not build or load ({type(err).__name__}: {_first_line(err)})", None
    _registered[path] = Library(chosen, path, targets, lib)
    return None, _registered[path]


def _choose_isa(requested: str | None) -> str:
    """The instruction set to build for (one of :data:`ISAS` or a test build), else
    why none can be."""
    system, machine = platform.system(), platform.machine()
    if requested is not None and requested not in (*ISAS, *TEST_BUILDS):
        return f"{ISA_ENV}={requested!r} is not one of {', '.join((*ISAS, *TEST_BUILDS))}"
    if system != "Linux" or machine not in _X86_64 + _AARCH64:
        return (f"it needs Linux on x86-64 with AVX2 and FMA, or on aarch64 (this is "
                f"{system} {machine})")
    if machine in _AARCH64:
        if requested not in (None, "neon"):
            return f"{ISA_ENV}={requested} needs an x86-64 CPU (this is {machine})"
        return "neon"
    if requested == "neon":
        return f"{ISA_ENV}=neon needs an aarch64 CPU (this is {machine})"
    flags = cpu_flags()
    if requested is None:
        for best in ("amx", "avx512_bf16", "avx512"):
            if all(f in flags for f in _X86_NEEDS[best]):
                return best
        requested = "avx2"
    missing = [f for f in _X86_NEEDS[requested] if f not in flags]
    if missing:
        return (f"the {ISA_NAMES[requested]} build needs a CPU with "
                f"{', '.join(_X86_NEEDS[requested])} (this CPU has no {', '.join(missing)})")
    return requested


def cpu_flags() -> frozenset[str]:
    """The CPU's flags from /proc/cpuinfo (x86-64 "flags", aarch64 "Features"); empty
    where it cannot be read. Read once per process (the dense products ask at every
    bfloat16 product they trace)."""
    info = _cpuinfo()
    return frozenset(info.get("flags", info.get("Features", "")).split())  # x86-64; aarch64


def cpu_vendor() -> str:
    """The x86-64 CPU's vendor from /proc/cpuinfo (``"GenuineIntel"``,
    ``"AuthenticAMD"``), else ``""``: the dense products' libraries pick their kernels
    by it (:mod:`.gemm`)."""
    return _cpuinfo().get("vendor_id", "")


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _cache_dir() -> pathlib.Path:
    given = os.environ.get("JAX_DILATED_CACHE")
    if given:
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jax_dilated"


def _build(compiler: str, isa_: str, source: pathlib.Path) -> pathlib.Path:
    """The cached library for this source, instruction set, compiler, jaxlib and CPU;
    compiled if absent (into a temporary file renamed into place, so that concurrent
    processes agree). Processes that start together (the processes of one host, test
    workers) compile it once: the first holds a lock beside it while it compiles, and
    the others wait and then find it."""
    import jaxlib

    include = jax.ffi.include_dir()
    flags = (*_FLAGS, *_ISA_FLAGS[isa_])
    key = hashlib.sha256()
    for part in (source.read_bytes(), GEMM_SOURCE.read_bytes(), HEADER.read_bytes(),
                 compiler.encode(),
                 " ".join(flags).encode(),
                 jaxlib.__version__.encode(), " ".join(sorted(cpu_flags())).encode(),
                 platform.processor().encode(), platform.machine().encode()):
        key.update(part + b"\0")
    cache = _cache_dir()
    library_path = cache / f"attention_cpu-{isa_}-{key.hexdigest()[:16]}.so"
    if library_path.exists():
        return library_path
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(library_path.with_suffix(".lock")):
        if not library_path.exists():
            _compile(compiler, flags, (source, GEMM_SOURCE), include, cache, library_path)
    return library_path


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """An exclusive lock on ``path`` (created if absent) while the block runs (builds
    happen on Linux only: _choose_isa)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(compiler: str, flags: tuple, sources: tuple[pathlib.Path, ...], include: str,
             cache: pathlib.Path, library_path: pathlib.Path) -> None:
    """``sources`` compiled to ``library_path`` through a temporary file in ``cache``."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        run = subprocess.run([compiler, *flags, f"-I{include}", f"-I{HEADER.parent}",
                              *map(str, sources), "-o", tmp],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-500:]}")
        os.replace(tmp, library_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _self_test(path: pathlib.Path) -> str | None:
    """None when the library's self-test passes (a small bfloat16 attention and its
    gradients against float64 loops, in a child process: an instruction the CPU
    refuses kills the child alone), else why not. The verdict is cached beside the
    library."""
    verdict = path.with_suffix(".selftest")
    if verdict.exists():
        text = verdict.read_text()
        return None if text == "ok" else text
    code = (f"import ctypes, sys; sys.exit(ctypes.CDLL({str(path)!r}).{_SELF_TEST_SYMBOL}())")
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        failed = (None if run.returncode == 0 else
                  "its self-test computed a wrong result" if run.returncode == 1 else
                  f"its self-test stopped (exit {run.returncode}: "
                  f"{(run.stderr.strip().splitlines() or [''])[-1][:200]})")
    except subprocess.SubprocessError as err:
        failed = f"its self-test did not finish ({type(err).__name__})"
    verdict.write_text("ok" if failed is None else failed)
    return failed


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
