"""Benchmarks of jax-dilated: ``python -m benchmarks <op> [options]`` from the repository root.

Ops (``python -m benchmarks <op> --help`` lists each one's options):

  dilated       jd.dilated_attention on one device against its peers in one interleaved
                set: torch SDPA per dilated segment, the dilated-attention-pytorch library,
                jax.nn.dot_product_attention and tokamax per dilated segment; forward and
                forward+backward, GFLOP/s against an attention-shaped block matmul timed in
                the same set, compiled temp memory against n.
  ring, distributed, block_sparse, gpu, lm   (see their modules)

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
"""
