#!/usr/bin/env bash
# bfloat16 training throughput and MFU of ViT-B/16 and ViT-L/16 at 224 px, at batch 64 and 256,
# on one GPU: the device check of issue 9, a few minutes on an H100/H200-class GPU.
#
# Usage (from the repository root, with a JAX that has a GPU backend, e.g.
# pip install -e . 'jax[cuda13]'):
#   launch/gpu_benchmark.sh [OUT_DIR]        (default: $OUT if set, else ./gpu_benchmark)
#   launch/gpu_benchmark.sh -h | --help      (the usage; a directory named like an option: -- DIR)
#
# Each batch size is one `python -m benchmarks` run (training step only: the trainer's own
# step, vit_jax.step, in the pretraining regime: forward, backward, AdamW, bfloat16 compute with
# float32 parameters and a float32 loss, the training defaults scan=True + remat
# 'dots_and_attention_saveable', the attention 'auto' picks for the GPU, cuDNN's fused attention
# in bfloat16; the report's notes say which ran and why). It prints the table and writes
# OUT_DIR/bf16_b{64,256}.{txt,json}. '% of peak' is the MFU: the analytic model FLOPs
# (3 x 2 x forward MACs per image, no recomputation counted) per second over the published dense
# bfloat16 peak of the GPU (vit_jax.accounting). Device memory peaks are in the JSON.
# Exit status: 0, 1 when a measurement failed, 2 for a bad argument or when JAX sees no GPU.
set -euo pipefail

PROG="launch/gpu_benchmark.sh"
# benchmarks/ is the repository's, not installed: its root first on the path, whatever the cwd.
REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

usage() {
  cat <<EOF
Usage: $PROG [OUT_DIR]

bfloat16 training throughput and MFU of ViT-B/16 and ViT-L/16 at 224 px, batch 64 and 256, on
one GPU (python -m benchmarks). Writes OUT_DIR/bf16_b{64,256}.{txt,json}; OUT_DIR
defaults to \$OUT if set, else ./gpu_benchmark. A directory whose name starts with '-' goes
after --: $PROG -- -dir.

Options:
  -h, --help   this help

Exit status: 0, 1 when a measurement failed, 2 for a bad argument or when JAX sees no GPU.
EOF
}

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

dirs=()
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --) shift; dirs+=("$@"); break ;;
    -*) die "unknown option '$1' (see '$PROG --help')" ;;
    *) dirs+=("$1") ;;
  esac
  shift
done
if ((${#dirs[@]} > 1)); then
  die "one OUT_DIR at most, got ${#dirs[@]}: ${dirs[*]} (see '$PROG --help')"
fi
if ((${#dirs[@]} == 1)) && [[ -z "${dirs[0]}" ]]; then
  die "OUT_DIR is empty: give a directory, or none for \$OUT or ./gpu_benchmark"
fi
out="${dirs[0]:-${OUT:-gpu_benchmark}}"

backend="$(python -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo 'jax missing')"
if [[ "$backend" != "gpu" ]]; then
  die "JAX sees no GPU (backend: $backend). Install a CUDA build of JAX, e.g. pip install 'jax[cuda13]' (and the project: pip install -e .)."
fi
mkdir -p -- "$out"
python -c 'import jax; print("devices:", jax.devices())'

for batch in 64 256; do
  python -m benchmarks ViT-B_16 ViT-L_16 --dtype bfloat16 --mode train \
    --batch "$batch" --warmup 3 --steps 10 --timeout 240 \
    --json="$out/bf16_b${batch}.json" | tee -- "$out/bf16_b${batch}.txt"
done
