"""Benchmarks of jax-dilated: ``python -m benchmarks <op> [options]`` from the repository root.

Ops (``python -m benchmarks <op> --help`` lists each one's options):

  dilated       jd.dilated_attention on one device against its peers in one interleaved
                set: torch SDPA per dilated segment, the dilated-attention-pytorch library,
                jax.nn.dot_product_attention and tokamax per dilated segment; forward and
                forward+backward, GFLOP/s against an attention-shaped block matmul timed in
                the same set, compiled temp memory against n.
  ring          ring attention over 8 simulated CPU devices: per-device compiled memory
                for P = 1, 2, 4, 8; the contiguous, zigzag and striped layouts and the
                ringattention peer timed interleaved and checked against one device; the
                critical path real devices would see, from each distinct ring step.
  distributed   jd.dilated_attention(seq_axis=...) over P = 1, 2, 4, 8 simulated devices:
                per-device memory, collectives in the HLO, k/v bytes per ring step, time;
                --allgather compares a spanning branch as a ring and as an all-gather.
  block_sparse  jd.block_sparse_attention against density next to exact attention: time
                (one interleaved set), compiled memory on one device and per ring device.
  gpu           the kernels on one accelerator: dilated (both modes), its segment
                kernels, one ring device's share, dense, torch SDPA per segment; time,
                tokens/s, TFLOP/s, memory, and the Markdown table of docs/benchmarks.md.
  lm            LongNetLM: training-step compiled memory against n and step time;
                KV-cache decoding time per token at a short and a long context.
  slide         Prov-GigaPath's slide encoder (issue 49): jd.models.SlideEncoder against
                Prov-GigaPath's own PyTorch module (from --gigapath-src, torch's CPU flash
                kernel for flash-attn) with the same weights, interleaved forward time and
                output difference at 10K tiles; compiled memory against the tile count,
                per device over P simulated devices (--devices 8) at 64K tiles; one
                forward at 100K tiles on one CPU with its peak RSS.
  packed        packed sequences (segment_ids, issue 17): D documents packed in one
                row of n against the costs the issue compares them with, each in one
                interleaved set with temp memory and an equality check: the causal
                ring over P simulated devices against one n-token document (target
                <= 0.25x fwd+bwd, same per-device memory; plus the ring steps and
                kernel blocks the skip rules run, from the ids), dilated attention
                against the documents as a batch (<= 1.3x, equal results; both modes,
                segments scaled to the document), block-sparse with the ids against
                the static pattern of the same blocks (<= 1.3x); PASS/FAIL per target.
  window        sliding windows, soft-capping and sinks (issue 18), three interleaved
                sets with temp memory and PASS/FAIL: the causal ring over P simulated
                devices with window=(W, 0) against the same ring without (target <= 0.25x
                fwd+bwd; plus the ring steps and kernel blocks the skip rules run, from
                the positions: the shards still travel every hop), the token window on
                one device (jd.ring_attention and block-sparse + window=) against the
                smallest block-sparse LocalWindow cover of it (<= 1.2x), soft-cap and
                sinks against plain exact attention (<= 1.10x). Every variant is checked
                at a small size against a dense masked computation and, for windows,
                jax.nn.dot_product_attention(local_window_size=...).

Every op shares (``benchmarks/harness.py``): ``--threads N`` (default 2) pins the process
to N CPUs before JAX and torch start and gives torch N threads; ``--repeats`` interleaved
rounds after ``--warmup`` untimed calls, each round calling every variant once in a
rotating order, reporting the median and the spread (max - min) / median; ``--quick``;
``--json PATH`` (default ``results/benchmark_<op>.json``) and a PNG next to it
(``--no-plot`` skips it). Each result records the machine, versions, git commit and the
load average before and after the run.

Method: figures are published only from a quiet machine, where the 1-minute load average
stays below half the pinned cores before and after the run; otherwise every table of the
run carries a warning. Peers are optional: ``bash benchmarks/setup.sh`` installs them into
the benchmark's virtual environment; an op skips a missing peer and says how to get it.

The dilated op, as issue 16 measures it (float32, B=1, n=16384, 8 heads x 64, segments
2048/4096/8192, rates 1/2/4, head_groups and longnet, non-causal and causal, 2 pinned
threads, median of 7 interleaved rounds; all of these are the defaults)::

    bash benchmarks/setup.sh                  # once: tokamax, dilated-attention-pytorch, ...
    python -m benchmarks dilated --quick      # n=4096, 3 rounds: checks that everything runs
    python -m benchmarks dilated              # the measurement (JSON + PNG in results/)
    python -m benchmarks dilated --modes head_groups --causal no   # one table only

Every peer's output and gradients are checked against jax-dilated's before it is timed
(except dilated-attention-pytorch, whose normalisation differs: timed only); a table
whose run was not quiet ends with the load warning, and the JSON records the commit
(and whether the tree was dirty), so a published figure can be traced to its run.
"""
