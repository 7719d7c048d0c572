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
are counted per case, and every call of ours that returns is repeated with stock
Flax's ``dot_product_attention`` (NNX's in the NNX module, Linen's in the Linen
module) on the same arguments: the output's dtype and shape must be Flax's, and its
values too where both are concrete (not traced) and no dropout is drawn (ours draws
its own), at the tolerance of the output's dtype or of the dtype Flax computes in,
whichever is narrower (with ``force_fp32_for_softmax``, Flax's float32 output of
bfloat16 inputs comes from bfloat16 logits). A query row with no key to attend
to is left out of the value comparison: there ours outputs zeros
(docs/semantics.md) and Flax the mean of the values.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
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
import jax
import jax.numpy as jnp
import numpy as np
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


#: relative tolerance (to max(max |Flax's output|, 1)) of a value comparison, by
#: dtype; float64 as float32, which is all stock Flax computes there in places (NNX's
#: jax.nn.dot_product_attention, Linen's force_fp32_for_softmax)
VALUE_TOL = {"float64": 1e-5, "float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


def _dropout_drawn(kwargs) -> bool:
    return bool(kwargs.get("dropout_rate", 0.0)) and not kwargs.get("deterministic", False)


def _rows_with_keys(mask, shape):
    """Bool [batch..., q_len, heads] (broadcastable to ``shape``'s leading axes): the
    query rows of Flax's mask that may attend to some key (all, without a mask)."""
    if mask is None:
        return np.ones((1,) * (len(shape) - 1), bool)
    m = np.asarray(mask) != 0                    # [batch..., heads, q, kv] (broadcast)
    m = m.reshape((1,) * (len(shape) - m.ndim) + m.shape)
    return np.swapaxes(np.any(m, axis=-1), -1, -2)


def compare_with_stock(ours_out, stock: Callable, args, kwargs) -> tuple[str, bool]:
    """Stock Flax's attention on ``args`` / ``kwargs`` against ``ours_out``: the first
    difference ("" if none), and whether the values were compared."""
    params = inspect.signature(stock).parameters
    kw = {k: v for k, v in kwargs.items() if k in params}
    try:
        want = stock(*args, **kw)
    except Exception as err:  # noqa: BLE001 - reported as a difference
        return f"stock Flax raised {type(err).__name__}: {err}", False
    if (ours_out.dtype, ours_out.shape) != (want.dtype, want.shape):
        return (f"output {ours_out.dtype}{list(ours_out.shape)}, stock Flax "
                f"{want.dtype}{list(want.shape)}"), False
    traced = any(isinstance(x, jax.core.Tracer)
                 for x in (ours_out, want, kwargs.get("mask")))
    if traced or _dropout_drawn(kwargs):
        return "", False
    got, ref = (np.asarray(x, np.float64) for x in (ours_out, want))
    keep = np.broadcast_to(_rows_with_keys(kwargs.get("mask"), got.shape)[..., None],
                           got.shape)
    got, ref = np.where(keep, got, 0.0), np.where(keep, ref, 0.0)
    err = np.max(np.abs(got - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1.0)
    # Flax computes in `dtype` (else the inputs' common type) and may return a wider
    # type (Linen's force_fp32_for_softmax): its values are only as accurate as the
    # narrower of the two
    qkv = (*args, *(kwargs[n] for n in ("query", "key", "value") if n in kwargs))[:3]
    computed = kwargs.get("dtype")
    computed = jnp.result_type(*qkv) if computed is None else computed
    tol = max(VALUE_TOL.get(str(want.dtype), 1e-5),
              VALUE_TOL.get(jnp.dtype(computed).name, 1e-5))
    if not err <= tol:
        return f"{want.dtype} values differ from stock Flax: relative error {err:.2e}", True
    return "", True


@dataclasses.dataclass
class Ours:
    """Our attention function, counting its calls; with ``stock``, each call that
    returns is compared with stock Flax's (:func:`compare_with_stock`)."""

    fn: Callable
    stock: Callable | None = None
    calls: int = 0
    compared: int = 0        # calls whose output dtype and shape were compared
    valued: int = 0          # ... and of those, whose values were
    differences: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        @functools.wraps(self.fn)  # Linen filters keyword arguments by the signature
        def counted(*args, **kwargs):
            self.calls += 1
            out = self.fn(*args, **kwargs)
            if self.stock is not None:
                difference, valued = compare_with_stock(out, self.stock, args, kwargs)
                self.compared += 1
                self.valued += valued
                if difference:
                    self.differences.append(difference)
            return out
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
    compared: int = 0  # of those, compared with stock Flax (dtype and shape) ...
    valued: int = 0    # ... and values
    differences: tuple = ()  # how those calls differed from stock Flax


#: stock Flax's attention function, for each test module
STOCK = {"nnx": nnx.dot_product_attention, "linen": linen.dot_product_attention}


def ours_for_flax_tests(stock: Callable | None = None) -> Ours:
    return Ours(jd.attention_fn(segment_lengths=(SEGMENT,), dilation_rates=(1,)), stock)


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
    ours = ours_for_flax_tests(STOCK[which])
    module = load_module(which, ours.counted)
    outcomes = []
    for case in _cases(unittest.defaultTestLoader.loadTestsFromModule(module)):
        result = _Result()
        before = (ours.calls, ours.compared, ours.valued, len(ours.differences))
        with enable_x64(False):  # Flax's tests assume JAX's default (this suite enables it)
            case.run(result)
        if result.skipped:
            raise AssertionError(f"{case.id()} skipped itself: {result.skipped}")
        name = case.id().split(".", 1)[1]
        outcomes.append(Outcome(name, result.wasSuccessful(), result.first,
                                ours.calls - before[0], ours.compared - before[1],
                                ours.valued - before[2],
                                tuple(ours.differences[before[3]:])))
    return outcomes
