"""The pure pieces of the multi-device and GPU benchmark ops (``benchmarks/ring.py``,
``distributed.py``, ``gpu.py``): HLO collective counting, the ring-step plan of the
critical-path projection, and the GPU table's Markdown form. Cheap: nothing is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mesh import build_mesh
from jax.sharding import PartitionSpec as P

from benchmarks import distributed, gpu, ring


def _hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_collectives_and_permute_bytes_of_a_compiled_program():
    """One ppermute of a [16, 8] float32 shard moves 512 bytes per device; an
    all-gather is counted as such, not as a permute."""
    mesh = build_mesh((2,), ("seq",), "explicit")
    x = jax.ShapeDtypeStruct((32, 8), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, P("seq")))

    def swap(a):
        return jax.lax.ppermute(a, "seq", perm=[(0, 1), (1, 0)])

    def gather(a):
        return jax.lax.all_gather(a, "seq", tiled=True)

    hlo = _hlo(jax.shard_map(swap, mesh=mesh, in_specs=P("seq"), out_specs=P("seq")), x)
    assert distributed.permutes_in(hlo) == [16 * 8 * 4]
    assert distributed.collectives_in(hlo) == {"collective-permute": 1}
    hlo = _hlo(jax.shard_map(gather, mesh=mesh, in_specs=P("seq"), out_specs=P(),
                             check_vma=False), x)
    assert distributed.permutes_in(hlo) == []
    assert distributed.collectives_in(hlo) == {"all-gather": 1}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_step_plan_contiguous_vs_zigzag(p):
    """Causal contiguous ring: device d computes at step s iff its key block comes
    from a device at or before it (P (P + 1) / 2 of the P^2 steps), the last device
    every step. Zigzag: every device computes at every step (balanced)."""
    n = 2 * p * 256
    block = ring.ring_block(n // p, "contiguous")
    steps = ring.step_patterns(n, p, "contiguous", block, causal=True)
    active = np.array([[key is not None for key in row] for row in steps])
    want = np.array([[(d - s) % p <= d for d in range(p)] for s in range(p)])
    np.testing.assert_array_equal(active, want)
    assert active.sum() == p * (p + 1) // 2
    zz = ring.step_patterns(n, p, "zigzag", ring.ring_block(n // p, "zigzag"), causal=True)
    assert all(key is not None for row in zz for key in row)
    full = ring.step_patterns(n, p, "contiguous", block, causal=False)
    assert len({key for row in full for key in row}) == 1  # one distinct (full) step


def test_ring_block_is_the_largest_divisor_up_to_512():
    assert ring.ring_block(1024, "contiguous") == 512
    assert ring.ring_block(1024, "zigzag") == 512
    assert ring.ring_block(768, "contiguous") == 384
    assert ring.ring_block(768, "zigzag") == 384
    assert ring.ring_block(1000, "contiguous") == 500


def test_gpu_markdown_table_is_what_the_docs_section_and_notebook_read():
    """One ``|`` header, one separator and one ``|`` row per cell (errors included),
    after a line naming the date, commit and device."""
    env = {"date_utc": "2026-01-01T00:00:00Z", "git_commit": "0123456789abcdef",
           "git_dirty": False, "device_kind": "NVIDIA H100", "nvidia_smi": "H100, 550, 80 GiB",
           "jax": "0.10.2", "torch": "2.13.0", "load": {"warning": None}}
    cfg = {"batch": 1, "heads": 16, "head_dim": 128, "dtype": "bfloat16",
           "segments": (2048, 4096), "rates": (1, 2), "causal": False, "repeats": 5}
    ok = {"op": "dilated/head_groups", "n": 16384, "pass": "forward", "median_s": 0.0125,
          "spread": 0.02, "tokens_per_s": 1.31e6, "tflops": 41.5,
          "compiled_memory": {"temp": 3 * 2 ** 20}, "device_memory_after": None}
    bad = {"op": "dense", "n": 1048576, "pass": "forward", "error": "XlaRuntimeError: OOM"}
    md = gpu.markdown_table({"environment": env, "config": cfg, "results": [ok, bad]})
    lines = md.splitlines()
    assert lines[0].startswith("Recorded 2026-01-01T00:00:00Z at commit 0123456 on NVIDIA H100")
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 4
    assert table[0] == "| " + " | ".join(gpu.HEADERS) + " |"
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in table[2:]]
    assert cells[0][:7] == ["dilated/head_groups", "16384", "forward", "12.5", "2.0%",
                            "1.31e+06", "41.50"]
    assert cells[0][7] == "3.0 MiB"
    assert cells[1][:4] == ["dense", "1048576", "forward", "error"]
    assert all(len(c) == len(gpu.HEADERS) for c in cells)
