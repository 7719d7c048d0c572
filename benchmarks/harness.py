"""The one benchmark harness: threads, timing, memory, environment, tables, JSON.

Every op module (``benchmarks/<op>.py``) builds on these pieces:

* :func:`pin_threads` pins the process to N CPUs *before* JAX or PyTorch start
  (XLA sizes its CPU thread pool from the schedulable CPUs); :func:`torch_threads`
  gives torch the same count.
* :func:`time_interleaved` times several variants call by call, in a rotating
  order, so that every variant sees the same machine load; it returns a
  :class:`Timing` (all samples, median, spread) per variant. :func:`paired_ratio`
  compares two variants round by round.
* :func:`compiled_memory` / :func:`temp_bytes`: XLA's ``memory_analysis()`` of the
  compiled program (deterministic, so tests use it too). This module imports
  nothing heavier than JAX, and JAX only inside the functions that need it.
* :class:`LoadMonitor` records the load average before and after a run;
  :func:`print_table` prints its warning under every table of a loaded run.
* :func:`environment`: the record saved with every result (machine, versions,
  commit, load).
* :func:`register`: op modules register ``run(args) -> payload`` with their
  argparse options; ``benchmarks/__main__.py`` adds the options every op shares
  (``--threads``, ``--repeats``, ``--warmup``, ``--quick``, ``--json``,
  ``--no-plot``; see :func:`add_common_arguments`, so an op's ``add_arguments``
  must not add them) and puts a started :class:`LoadMonitor` in ``args.load``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "OPS",
    "LoadMonitor",
    "MemoryStats",
    "Op",
    "Progress",
    "Timing",
    "add_common_arguments",
    "compiled_memory",
    "environment",
    "fmt_bytes",
    "fmt_ms",
    "fmt_spread",
    "int_list",
    "max_rel_diff",
    "paired_ratio",
    "pin_threads",
    "print_table",
    "register",
    "str_list",
    "temp_bytes",
    "time_calls",
    "time_interleaved",
    "torch_threads",
    "write_json",
]


# ------------------------------------------------------------------------ threads

def pin_threads(threads: int) -> int:
    """Pin this process to ``threads`` CPUs; returns the number of CPUs it may use.

    Call before JAX or torch is imported: XLA's CPU client sizes its thread pool
    from the schedulable CPUs (so affinity is what limits JAX), and the OpenMP/MKL/
    OpenBLAS pools read their ``*_NUM_THREADS`` variables when they start. Fewer
    CPUs than asked for (a smaller machine) pins to all of them.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity, the variables only
        cpus = list(range(min(threads, os.cpu_count() or threads)))
    else:
        if threads < len(cpus):
            cpus = cpus[:threads]
            os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(len(cpus))
    return len(cpus)


def torch_threads(threads: int):
    """Import torch with ``threads`` intra-op threads (and 1 inter-op); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before torch's first parallel work
        pass
    return torch


# ----------------------------------------------------------------------- progress

class Progress:
    """Step counter on stderr: a tqdm bar on a terminal when tqdm is installed, else lines."""

    def __init__(self, total: int, desc: str):
        self._start = time.perf_counter()
        self._total, self._done = total, 0
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
                                 bar_format="{desc}: {n}/{total} |{bar}| {elapsed} {postfix}")
        if self._bar is None:
            print(f"[{desc}] {total} steps", file=sys.stderr, flush=True)

    def start(self, what: str) -> None:
        """Announce the step that begins now."""
        if self._bar is not None:
            self._bar.set_postfix_str(what)
        else:
            elapsed = time.perf_counter() - self._start
            print(f"  [{self._done + 1}/{self._total}] {what} (t={elapsed:.0f}s)",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        """Mark the current step finished."""
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ------------------------------------------------------------------------- timing

@dataclasses.dataclass
class Timing:
    """Wall-clock samples (seconds) of one variant.

    ``spread`` is ``(max - min) / median``: the whole range of the samples relative
    to the median (0.05 = the slowest call took 5 % of the median longer than the
    fastest). ``iqr`` is the interquartile range in seconds, for a robust view.
    """

    samples: list[float]

    def __post_init__(self):
        if not self.samples:
            raise ValueError("Timing needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        return (self.max - self.min) / self.median

    @property
    def iqr(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q3 - q1

    def to_json(self) -> dict:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max,
                "spread": self.spread, "iqr_s": self.iqr, "samples_s": list(self.samples)}


def _block_default(x):
    """Wait for ``x``: ``jax.block_until_ready`` (torch CPU results are ready anyway)."""
    if "jax" in sys.modules:
        import jax
        return jax.block_until_ready(x)
    return x


def time_calls(fn: Callable[[], object], *, repeats: int, warmup: int = 1,
               block: Callable[[object], object] | None = None) -> Timing:
    """Samples of ``fn()`` (``block`` applied to its result) after ``warmup`` calls."""
    return time_interleaved({"fn": fn}, repeats=repeats, warmup=warmup, block=block)["fn"]


# Untimed calls of a variant right before each of its timed calls. What the previous
# variant left behind slows the next call down: torch's OpenMP workers spin-wait after a
# parallel region, and after a peer frees gigabytes of temporaries the kernel zeroes and
# compacts (transparent huge) pages in the background. Measured on the 2-core CI machine
# kind: a call that takes 120 ms back to back took 215 ms right after the
# jax.nn-per-segment peer. A pause does not fix it (an idle vCPU comes back slower: the
# same call took 125-145 ms after 2 s of sleep); one untimed call of the same variant
# first absorbs it, so each timed call is a back-to-back call, as in a training loop.
LEAD_IN = 1


def time_interleaved(calls: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                     block: Callable[[object], object] | None = None,
                     lead_in: int = LEAD_IN) -> dict[str, Timing]:
    """Time several variants call by call, so they share the machine's load.

    Every call is first made ``warmup`` times (untimed). Then ``repeats`` rounds:
    round ``i`` calls every variant once, starting with variant ``i mod k`` of the
    ``k`` variants and going round (a rotating order, so no variant always runs
    right after the same neighbour, nor always first in a round). Each call is
    timed until ``block(result)`` returns (default ``jax.block_until_ready``,
    which leaves non-JAX values such as torch CPU tensors alone), right after
    ``lead_in`` untimed calls of the same variant (see ``LEAD_IN``).

    Returns ``{name: Timing}``; sample ``i`` of every variant comes from round ``i``
    (so :func:`paired_ratio` can compare them round by round).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    block = _block_default if block is None else block
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            block(calls[name]())
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        start = i % len(names)
        for name in names[start:] + names[:start]:
            for _ in range(lead_in):
                block(calls[name]())
            t0 = time.perf_counter()
            block(calls[name]())
            samples[name].append(time.perf_counter() - t0)
    return {name: Timing(samples[name]) for name in names}


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over rounds of ``a_i / b_i`` (samples of the same interleaved round)."""
    if len(a.samples) != len(b.samples):
        raise ValueError(f"paired_ratio needs samples of the same rounds, got "
                         f"{len(a.samples)} and {len(b.samples)}")
    return statistics.median(x / y for x, y in zip(a.samples, b.samples))


# ------------------------------------------------------------------------- memory

@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Bytes of a compiled XLA program (``memory_analysis()``): temp buffers,
    arguments, outputs, aliased (donated) bytes and the generated code."""

    temp: int
    argument: int
    output: int
    alias: int
    generated_code: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compiled_memory(fn: Callable, *args, **jit_kwargs) -> MemoryStats:
    """Memory of ``jax.jit(fn, **jit_kwargs)`` compiled for ``args``.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` (nothing is computed).
    ``temp`` is the scratch memory the program needs beyond its arguments and
    outputs: the number that shows whether an attention kernel is O(n) or O(n^2).
    """
    import jax
    analysis = jax.jit(fn, **jit_kwargs).lower(*args).compile().memory_analysis()
    if analysis is None:
        raise RuntimeError(f"{jax.default_backend()} backend gives no memory_analysis()")

    def get(name):
        return int(getattr(analysis, f"{name}_size_in_bytes", 0) or 0)

    return MemoryStats(temp=get("temp"), argument=get("argument"), output=get("output"),
                       alias=get("alias"), generated_code=get("generated_code"))


def temp_bytes(fn: Callable, *args, **jit_kwargs) -> int:
    """``compiled_memory(fn, *args, **jit_kwargs).temp``."""
    return compiled_memory(fn, *args, **jit_kwargs).temp


# --------------------------------------------------------------------------- load

def _busy_seconds() -> tuple[float, float] | None:
    """``(CPU seconds the whole machine has been busy, CPU seconds of this process and its
    children)``, or None where ``/proc/stat`` does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: busy = all but idle, iowait
    ticks = [int(x) for x in fields[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system + own.children_user + own.children_system


class LoadMonitor:
    """Whether anything else used the machine while a run was timing.

    ``before``: the 1-minute load average when the run starts (what other processes
    were doing just before). ``others``: the average number of CPUs other processes kept
    busy during the run, from the machine's busy time (``/proc/stat``) minus this
    process's own CPU time. ``after``: the load average at the end, kept for the record
    only: the run's own threads raise it to about their number, so it cannot tell a quiet
    run from a loaded one. A run is ``quiet`` when ``before`` and ``others`` are both
    below half the pinned cores (``threads / 2``): above that, other processes compete
    for the cores being timed, and torch's thread pool suffers more than XLA's, so ratios
    drift. Without ``/proc/stat`` the end's load average stands in for ``others``.
    Figures from a run that is not quiet must not be published; :meth:`warning` says so.
    ``getloadavg`` and ``busy_seconds`` are injectable (tests fake them).
    """

    def __init__(self, threads: int, getloadavg: Callable[[], tuple] = os.getloadavg,
                 busy_seconds: Callable[[], tuple | None] = _busy_seconds):
        self.threads = threads
        self._getloadavg = getloadavg
        self._busy_seconds = busy_seconds
        self.before = self._read()
        self._start = (time.monotonic(), busy_seconds())
        self.after: tuple[float, float, float] | None = None
        self._others: float | None = None
        self._stopped = False

    def _read(self):
        try:
            return tuple(round(float(x), 2) for x in self._getloadavg())
        except OSError:  # not available on this platform
            return None

    def _measure_others(self) -> float | None:
        t0, start = self._start
        now = self._busy_seconds()
        elapsed = time.monotonic() - t0
        if start is None or now is None or elapsed <= 0:
            return None
        return round(max(0.0, (now[0] - start[0]) - (now[1] - start[1])) / elapsed, 2)

    def stop(self) -> None:
        """Record the end of the run now (a later call records again)."""
        self.after = self._read()
        self._others = self._measure_others()
        self._stopped = True

    @property
    def others(self) -> float | None:
        """CPUs kept busy by other processes during the run (so far, if not stopped)."""
        return self._others if self._stopped else self._measure_others()

    @property
    def threshold(self) -> float:
        return self.threads / 2

    @property
    def worst(self) -> float | None:
        """The higher of the load before the run and the other processes' CPUs during it
        (the end's load average where the latter cannot be measured)."""
        others = self.others
        if others is None:
            after = self.after if self._stopped else self._read()
            others = None if after is None else after[0]
        loads = [x for x in (None if self.before is None else self.before[0], others)
                 if x is not None]
        return max(loads) if loads else None

    @property
    def quiet(self) -> bool:
        worst = self.worst
        return worst is not None and worst < self.threshold

    def warning(self) -> str | None:
        """The warning line for a run that is not quiet, else None."""
        worst = self.worst
        if worst is None:
            return ("WARNING: load average unavailable on this platform: figures from this "
                    "run are not publishable")
        if worst < self.threshold:
            return None
        return (f"WARNING: load average {worst:.2f} >= {self.threshold:g} (half of "
                f"{self.threads} cores): figures from this run are not publishable")

    def to_json(self) -> dict:
        return {"before_1_5_15": self.before, "after_1_5_15": self.after,
                "others_cpus": self.others, "threshold": self.threshold,
                "quiet": self.quiet, "warning": self.warning()}


# -------------------------------------------------------------------- environment

def cpu_description(cpuinfo: str) -> str | None:
    """The CPU from ``/proc/cpuinfo``'s text: its model name, and its family, model
    number, widest vector unit and bfloat16 units, e.g. ``"AMD EPYC (family 25, model
    17, AVX-512, AVX512-BF16)"``.

    Cloud VMs often name the CPU only by its brand ("AMD EPYC"), and machines of one
    name differ: two such 2-core VMs ran the same block matmuls at 183 and 378
    GFLOP/s (docs/benchmarks.md), so a table must say which one it came from.
    """
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if name is None:
        return None
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    details = [f"family {fields['cpu family']}" if "cpu family" in fields else None,
               f"model {fields['model']}" if "model" in fields else None, vector,
               "AVX512-BF16" if "avx512_bf16" in flags else None,
               "AMX-BF16" if "amx_bf16" in flags else None]
    details = [d for d in details if d]
    return f"{name} ({', '.join(details)})" if details else name


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            described = cpu_description(f.read())
        if described:
            return described
    except OSError:
        pass
    return platform.processor() or None


def _git(*argv: str) -> str | None:
    try:
        out = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# optional peers whose versions are recorded when installed
PEER_DISTRIBUTIONS = ("tokamax", "ringattention", "einops", "dilated-attention-pytorch",
                      "torchscale", "flax")


def environment(threads: int, load: LoadMonitor) -> dict:
    """The record saved with every result.

    Date (UTC), CPU model, logical cores, pinned threads, Python, JAX/jaxlib and
    their backend and devices, torch (version from the package metadata, so torch
    is not imported when absent or unused), the installed peers, git commit and
    whether the tree had uncommitted changes, platform, the variables that choose the
    BLAS libraries' kernels (``OPENBLAS_CORETYPE`` holds OpenBLAS to one CPU's kernels,
    and some machines set it), and the load before and after. Call it after the timed
    work: it records the load at the end (:meth:`LoadMonitor.stop`).
    """
    import jax
    load.stop()
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    devices = jax.devices()
    info = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "jax_backend": jax.default_backend(),
        "jax_devices": f"{len(devices)} x {devices[0].device_kind}",
        "torch": _version("torch"),
        "peers": {name: v for name in PEER_DISTRIBUTIONS if (v := _version(name))},
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "load": load.to_json(),
        "blas_variables": {k: v for k, v in sorted(os.environ.items())
                           if k.startswith(("OPENBLAS_", "MKL_", "ONEDNN_"))},
    }
    if "torch" in sys.modules:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    return info


# ---------------------------------------------------------------- output, argparse

def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` as indented JSON (creating the folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(x):
    if hasattr(x, "to_json"):
        return x.to_json()
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    return str(x)


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def fmt_spread(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_table(title: str, headers: list[str], rows: list[list[str]], *,
                env: dict | LoadMonitor | None = None, file=None) -> None:
    """Aligned text table on stdout, with the load warning under it when the run was
    not quiet (``env``: this run's :func:`environment` dict or its LoadMonitor)."""
    file = sys.stdout if file is None else file
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(title, file=file)
    print(line, file=file)
    print("-" * len(line), file=file)
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)
    warning = None
    if isinstance(env, LoadMonitor):
        warning = env.warning()
    elif env is not None:
        warning = env.get("load", {}).get("warning")
    if warning:
        print(warning, file=file)
    print(file=file)


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: ``"1,2,4"`` -> ``(1, 2, 4)``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def str_list(text: str) -> tuple[str, ...]:
    """argparse type: ``"a,b"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def max_rel_diff(a, b) -> dict:
    """``{"max_abs_diff", "rel_to_max"}``: max |a - b| and that over max |b| (float64)."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    diff = float(np.max(np.abs(a - b)))
    return {"max_abs_diff": diff, "rel_to_max": diff / max(float(np.max(np.abs(b))), 1e-30)}


@dataclasses.dataclass
class Op:
    """A registered benchmark: ``python -m benchmarks <name>``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict]
    repeats: int
    quick_repeats: int


OPS: dict[str, Op] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             *, repeats: int = 7, quick_repeats: int = 3):
    """Decorator registering ``run(args) -> JSON-able payload`` as op ``name``.

    ``add_arguments(parser)`` adds the op's own options; the shared ones come
    from :func:`add_common_arguments`, where ``--repeats`` defaults to ``repeats``
    (``quick_repeats`` with ``--quick``). The payload should carry
    ``"benchmark": name`` and ``"environment"`` (for the plots).
    """
    def decorate(run):
        OPS[name] = Op(name, help, add_arguments, run, repeats, quick_repeats)
        return run
    return decorate


def add_common_arguments(parser: argparse.ArgumentParser, op: Op) -> None:
    """The options every op has; ``resolve_common`` fills ``--repeats`` afterwards."""
    parser.add_argument("--threads", type=int, default=2,
                        help="CPUs the process is pinned to, for XLA's pool and torch's "
                             "(default 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed interleaved rounds, median reported (default "
                             f"{op.repeats}; --quick {op.quick_repeats})")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls of every variant after compiling (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="a small configuration that checks the op end to end quickly")
    default_json = f"results/benchmark_{op.name}.json"
    parser.add_argument("--json", default=str(ROOT / default_json),
                        help=f"where to write the results (default {default_json})")
    parser.add_argument("--no-plot", action="store_true",
                        help="skip the PNG plot written next to the JSON (needs matplotlib)")


def resolve_common(args: argparse.Namespace, op: Op) -> None:
    """Fill ``args.repeats`` from the op's defaults when it was not given."""
    if args.repeats is None:
        args.repeats = op.quick_repeats if args.quick else op.repeats
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
