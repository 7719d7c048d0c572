"""Flax's own attention tests, run with ``jd.attention_fn`` as the attention function.

Flax's tests are not in its wheel, so the sdist of the installed Flax version is
fetched once with pip (``pip download --no-binary :all: --no-deps flax==<version>``)
and its two attention test modules are kept in a cache directory
(``$JAX_DILATED_CACHE`` or ``~/.cache/jax-dilated``), outside ``tests/`` so that pytest
never collects them. ``$JAX_DILATED_FLAX_SOURCE`` may name a Flax source tree instead.
Nothing of Flax's is copied into this repository.

A test module is imported from that file, then its globals ``nnx`` / ``linen`` /
``nn`` are replaced by proxies of the real modules in which

* ``MultiHeadAttention`` (NNX), ``MultiHeadDotProductAttention`` and
  ``MultiHeadAttention`` (Linen) default to ``attention_fn=<ours>`` (subclasses with
  the same class names, so Linen's automatic submodule names are unchanged), and
* ``dot_product_attention`` is ours,

so every attention the tests compute goes through dilated attention. ``<ours>`` is
``jd.attention_fn`` with one segment at least as long as any sequence in the tests and
dilation rate 1, which is exactly dense softmax attention (docs/semantics.md, "Short
last segment, segment longer than the sequence"), i.e. what the tests expect of
Flax's own function. Each test case then runs under :mod:`unittest`; calls of ours
are counted per case.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from collections.abc import Callable
from typing import Any

import flax
from flax import linen, nnx

import jax_dilated as jd

try:
    from jax import enable_x64
except ImportError:  # JAX before 0.8
    from jax.experimental import enable_x64

#: the two test modules, as paths inside Flax's sdist
MODULES = {"nnx": "tests/nnx/nn/attention_test.py",
           "linen": "tests/linen/linen_attention_test.py"}

#: dense attention for every sequence length the Flax tests use (at most 16)
SEGMENT = 64


class Unavailable(Exception):
    """Flax's test sources cannot be had here (no network, no pip): skip, with why."""


# ------------------------------------------------------------------------ the sources


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAX_DILATED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax-dilated")
    return pathlib.Path(root) / f"flax-{flax.__version__}-tests"


def flax_test_sources() -> pathlib.Path:
    """A directory holding :data:`MODULES` of the installed Flax version (downloaded
    and extracted on first use); raises :class:`Unavailable` when it cannot."""
    source = os.environ.get("JAX_DILATED_FLAX_SOURCE")
    if source:
        root = pathlib.Path(source)
        missing = [p for p in MODULES.values() if not (root / p).is_file()]
        if missing:
            raise Unavailable(f"JAX_DILATED_FLAX_SOURCE={source} lacks {missing}")
        return root
    cache = _cache_dir()
    if all((cache / p).is_file() for p in MODULES.values()):
        return cache
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--no-binary", ":all:", f"flax=={flax.__version__}", "-d", tmp]
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise Unavailable(f"pip download of the flax sdist failed: {err}") from None
        sdists = sorted(pathlib.Path(tmp).glob("flax-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise Unavailable(f"pip download of the flax=={flax.__version__} sdist "
                              f"failed (no network?): {tail}")
        staging = pathlib.Path(tmp) / "extracted"
        with tarfile.open(sdists[0]) as tar:
            top = tar.getnames()[0].split("/")[0]
            for path in MODULES.values():
                member = tar.getmember(f"{top}/{path}")
                target = staging / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
        cache.parent.mkdir(parents=True, exist_ok=True)
        try:  # atomic: another worker may have got there first
            os.rename(staging, cache)
        except OSError:
            if not all((cache / p).is_file() for p in MODULES.values()):
                shutil.rmtree(cache, ignore_errors=True)
                os.rename(staging, cache)
    return cache


# ------------------------------------------------------------------------- patching


class _Proxy(types.ModuleType):
    """A module that is ``real`` except for the attributes given."""

    def __init__(self, real, **overrides):
        super().__init__(real.__name__)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._real, name)


@dataclasses.dataclass
class Ours:
    """Our attention function, counting its calls."""

    fn: Callable
    calls: int = 0

    def __post_init__(self):
        @functools.wraps(self.fn)  # Linen filters keyword arguments by the signature
        def counted(*args, **kwargs):
            self.calls += 1
            return self.fn(*args, **kwargs)
        self.counted = counted


def _patched_namespaces(ours: Callable) -> dict[str, _Proxy]:
    class NnxMultiHeadAttention(nnx.MultiHeadAttention):
        def __init__(self, *args, attention_fn=ours, **kwargs):
            super().__init__(*args, attention_fn=attention_fn, **kwargs)

    class LinenMultiHeadDotProductAttention(linen.MultiHeadDotProductAttention):
        attention_fn: Callable[..., Any] = ours

    class LinenMultiHeadAttention(linen.MultiHeadAttention):
        attention_fn: Callable[..., Any] = ours

    # Linen names submodules after their class ("MultiHeadDotProductAttention_0")
    NnxMultiHeadAttention.__name__ = "MultiHeadAttention"
    LinenMultiHeadDotProductAttention.__name__ = "MultiHeadDotProductAttention"
    LinenMultiHeadAttention.__name__ = "MultiHeadAttention"
    nnx_proxy = _Proxy(nnx, MultiHeadAttention=NnxMultiHeadAttention,
                       dot_product_attention=ours)
    linen_proxy = _Proxy(linen, MultiHeadDotProductAttention=LinenMultiHeadDotProductAttention,
                         MultiHeadAttention=LinenMultiHeadAttention,
                         dot_product_attention=ours)
    return {"nnx": nnx_proxy, "linen": linen_proxy, "nn": linen_proxy}


def load_module(which: str, ours: Callable) -> types.ModuleType:
    """Flax's test module ``which`` (``"nnx"`` / ``"linen"``) with ``ours`` patched in."""
    path = flax_test_sources() / MODULES[which]
    name = f"_flax_upstream_{which}_attention_test"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for global_name, proxy in _patched_namespaces(ours).items():
        if global_name in vars(module):
            setattr(module, global_name, proxy)
    return module


# -------------------------------------------------------------------------- running


@dataclasses.dataclass
class Outcome:
    name: str          # "Class.test_method..."
    passed: bool
    error: str         # the exception's type and message ("" when passed)
    calls: int         # calls of our attention function


def ours_for_flax_tests() -> Ours:
    return Ours(jd.attention_fn(segment_lengths=(SEGMENT,), dilation_rates=(1,)))


def _cases(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from _cases(test)
        else:
            yield test


class _Result(unittest.TestResult):
    """Keeps the first exception as ``"Type: message"`` (a formatted traceback's last
    line can be JAX's note on filtered frames)."""

    first: str = ""

    def _keep(self, err):
        if not self.first:
            self.first = f"{err[0].__name__}: {err[1]}"

    def addError(self, test, err):
        self._keep(err)
        super().addError(test, err)

    def addFailure(self, test, err):
        self._keep(err)
        super().addFailure(test, err)


def run_module(which: str) -> list[Outcome]:
    """Run every test case of Flax's module ``which`` with our attention patched in."""
    ours = ours_for_flax_tests()
    module = load_module(which, ours.counted)
    outcomes = []
    for case in _cases(unittest.defaultTestLoader.loadTestsFromModule(module)):
        result = _Result()
        before = ours.calls
        with enable_x64(False):  # Flax's tests assume JAX's default (this suite enables it)
            case.run(result)
        if result.skipped:
            raise AssertionError(f"{case.id()} skipped itself: {result.skipped}")
        name = case.id().split(".", 1)[1]
        outcomes.append(Outcome(name, result.wasSuccessful(), result.first,
                                ours.calls - before))
    return outcomes
