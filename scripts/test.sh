#!/usr/bin/env bash
# Runs the whole test suite; sets everything up on a fresh machine first.
# Extra arguments go to pytest (e.g. one file: bash scripts/test.sh tests/test_models.py).
# The tests run on JD_TEST_WORKERS worker processes (pytest-xdist; default: one per
# CPU core, at most 4; 0 runs them in this process), whole files per worker.
source "$(dirname "$0")/_env.sh"
workers="${JD_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')}"
[ "$workers" = 1 ] && workers=0  # one worker: no point in a separate process
# --durations: the slowest tests in the log, where the suite's time goes
python -m pytest -q -n "$workers" --dist loadfile --durations=25 "$@"
