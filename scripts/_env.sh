# Shared set-up for scripts/test.sh and scripts/demo.sh: a virtual environment at
# .venv (or $JD_VENV) with the package, its test extras and the CPU build of PyTorch.
# Sourced, not run. Idempotent: a second run installs nothing new.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JD_VENV:-$ROOT/.venv}"
# Python 3.11: jax 0.10.x from PyPI, and the CPU wheel of torch 2.13.0 the parity
# suite uses (any other torch spec pulls CUDA packages). JD_PYTHON overrides it.
PY="${JD_PYTHON:-python3.11}"
if ! "$PY" --version >/dev/null 2>&1; then
  # pyenv installs interpreters it does not put on PATH (its shim refuses a version
  # that is not selected): look for the executable among its versions first.
  found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/"$PY" 2>/dev/null | tail -n 1)
  if [ -n "$found" ]; then
    PY="$found"
  elif [ -n "${JD_PYTHON:-}" ]; then
    echo "[jax-dilated] JD_PYTHON=$JD_PYTHON: no such interpreter" >&2
    exit 1
  else
    PY=python3
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[jax-dilated] creating virtual environment $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.jd-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_env.sh" | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[jax-dilated] installing jax-dilated[bench,train,mkl] (and torch==2.13.0 CPU on Python 3.11)"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>/dev/null || true
  if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  else
    # Elsewhere torch==2.13.0 has no local CPU wheel and would pull CUDA packages;
    # the PyTorch parity tests skip themselves without torch.
    echo "[jax-dilated] not Python 3.11: skipping torch (parity tests will be skipped)"
  fi
  # matplotlib: block patterns draw themselves (a test checks the picture);
  # nbclient, nbformat, ipykernel: tests/test_notebooks.py runs notebooks/
  # pytest-xdist: scripts/test.sh runs the tests on several processes (the test extra
  # lists it too; the extra itself is not installed here: its unpinned torch could
  # pull CUDA packages); mkl: the bfloat16 dense products' MKL call is tested on any
  # x86-64 CPU
  "$VENV/bin/python" -m pip install -q -e "$ROOT[bench,train,mkl]" pytest "pytest-xdist>=3" "hypothesis>=6" matplotlib \
    nbclient nbformat ipykernel
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
