"""The ``>>>`` examples in the public modules' docstrings run and print what they show.

One test per module (``doctest``, with ELLIPSIS and NORMALIZE_WHITESPACE); examples are
kept tiny so that the whole file runs in seconds. The examples of ``docs/semantics.md``
run the same way (one test for the page).
"""

from __future__ import annotations

import doctest
import importlib
import os

import pytest
from _mesh import require_devices

MODULES = [
    "jax_dilated",
    "jax_dilated.ops.dilated",
    "jax_dilated.ops.ring",
    "jax_dilated.ops.block_sparse",
    "jax_dilated.block_patterns",
    "jax_dilated.block_patterns.base",
    "jax_dilated.block_patterns.shapes",
    "jax_dilated.ops.decode",
    "jax_dilated.core.layouts",
    "jax_dilated.ops.sharded",
    "jax_dilated.ops.strategies.choice",
    "jax_dilated.layers.factory",
    "jax_dilated.layers.flax_adapter",
    "jax_dilated.layers.nnx",
    "jax_dilated.layers.projections",
    "jax_dilated.layers.linen",
    "jax_dilated.models.config",
    "jax_dilated.models.longnet",
    "jax_dilated.models.positions",
    "jax_dilated.models.encoder",
    "jax_dilated.models.slide",
    "jax_dilated.core.softmax",
    "jax_dilated.core.branch_plans",
    "jax_dilated.backends.report",
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tests(name: str):
    module = importlib.import_module(name)  # a renamed module fails here, as it should
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, name) if t.examples]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _tests(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_public_api_has_examples():
    """Every public function and class (jd.*, jd.nnx.*, jd.linen.*, jd.models.*,
    jd.block_patterns.*) shows an example."""
    import inspect

    import jax_dilated as jd

    names = [(f"jd.{n}", getattr(jd, n)) for n in jd.__all__
             if not inspect.ismodule(getattr(jd, n))]
    for sub in ("nnx", "linen", "models", "block_patterns"):
        module = getattr(jd, sub)
        names += [(f"jd.{sub}.{n}", getattr(module, n)) for n in module.__all__]
    missing = [n for n, obj in names if ">>>" not in (inspect.getdoc(obj) or "")]
    assert not missing, f"no >>> example in the docstring of: {missing}"


def test_semantics_doc_examples():
    """The ``>>>`` examples of docs/semantics.md run and print what the page shows
    (they need 4 devices: conftest.py gives JAX 8 CPU devices)."""
    require_devices(4)  # one GPU: its 1-device "mesh of 4" would print other results
    path = os.path.join(ROOT, "docs", "semantics.md")
    result = doctest.testfile(path, module_relative=False, optionflags=FLAGS,
                              report=True, verbose=False)
    assert result.attempted > 0, f"no examples found in {path}"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {path}"
