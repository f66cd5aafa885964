#!/usr/bin/env bash
# The CUDA backend's check on a machine with an NVIDIA GPU, from the repository root:
# exactness (GPU logits vs the CPU MLX path, Triton kernel vs its reference) and a
# short decode benchmark; prints a summary, writes $OUT/gpu_check.json when OUT is set.
#
#   scripts/gpu_check.sh --fetch-wheels   # here, online: MLX wheels for the GPU box -> .whl/
#   scripts/gpu_check.sh                  # on the GPU box (offline): install, check
#   scripts/gpu_check.sh --device cpu     # the same run on the CPU (a dry run)
#
# The GPU box is expected to have Python 3.12 with torch (CUDA), triton, transformers,
# numpy, safetensors; MLX and mlx-lm (the CPU reference path) come from .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=.whl
DEVICE=cuda
MLX_WHEELS=(mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 sentencepiece==0.2.3 protobuf==7.36.2)

fetch_wheels() {
  rm -rf "$WHEELS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${MLX_WHEELS[@]}"
  ls -l "$WHEELS"
  du -sh "$WHEELS"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --fetch-wheels) fetch_wheels; exit 0 ;;
    --device) DEVICE=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

TARGET=$(mktemp -d "${TMPDIR:-/tmp}/edgemoe-gpu-check.XXXXXX")
trap 'rm -rf "$TARGET"' EXIT
echo "+ python: $("$PY" -c 'import sys; print(sys.version.split()[0])'), target $TARGET"
if ! "$PY" -c "import mlx_lm, sentencepiece" 2>/dev/null; then
  ls "$WHEELS"/*.whl >/dev/null || { echo "gpu_check.sh: no MLX here and no $WHEELS/; run --fetch-wheels first" >&2; exit 1; }
  "$PY" -m pip install -q --no-deps --no-index --target "$TARGET" "$WHEELS"/*.whl
fi
# edgemoe itself, without dependencies (setuptools comes with torch); offline, a failed
# build falls back to the wheel's layout copied by hand: edgemoe/ with kernels/ inside
if ! "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --target "$TARGET" .; then
  echo "gpu_check.sh: pip could not build edgemoe here; copying the package instead" >&2
  cp -r edgemoe "$TARGET/" && cp -r kernels "$TARGET/edgemoe/kernels"
fi
export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, transformers, edgemoe.cuda, mlx.core, mlx_lm; \
print('+ torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'| transformers', transformers.__version__, '| mlx', mlx.core.__version__)"
JSON=()
if [[ -n "${OUT:-}" ]]; then JSON=(--json "$OUT/gpu_check.json"); fi
timeout 540 "$PY" scripts/gpu_check.py --device "$DEVICE" "${JSON[@]}"
