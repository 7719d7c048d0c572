#!/usr/bin/env bash
# Installs the optional peers of `python -m benchmarks` into the benchmark's virtual
# environment (.venv, or $JD_VENV; created by scripts/_env.sh like the tests' one):
#   * the `peers` extra of pyproject.toml: ringattention and einops (the `ring` op),
#     tokamax (the `dilated` op: tokamax.dot_product_attention per dilated segment);
#   * dilated-attention-pytorch==0.2.0 with --no-deps: its declared dependencies pin
#     xformers and torchscale, which would pull a CUDA build of torch; the `dilated`
#     op runs it on CPU through a small xformers shim (benchmarks/baselines/
#     dilated_attention_pytorch.py), and it needs only torch and einops.
# The versions of jax, jaxlib and torch already installed are held fixed (a peer must
# not upgrade them). Peers are never runtime dependencies of jax-dilated, nor in CI.
# Run from anywhere: `bash benchmarks/setup.sh`. Idempotent.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/scripts/_env.sh"   # cd's to the root
PY="$VENV/bin/python"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" -m pip freeze 2>/dev/null | grep -iE '^(jax|jaxlib|torch)==' > "$constraints" || true
echo "[benchmarks] installing the peers extra (held fixed: $(tr '\n' ' ' < "$constraints"))"
"$PY" -m pip install -q -c "$constraints" -e "$ROOT[peers]"
"$PY" -m pip install -q --no-deps "dilated-attention-pytorch==0.2.0"
"$PY" - <<'PY'
import importlib.metadata as md
for dist in ("jax", "jaxlib", "torch", "tokamax", "ringattention", "einops",
             "dilated-attention-pytorch"):
    try:
        print(f"[benchmarks] {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"[benchmarks] {dist} not installed")
PY
