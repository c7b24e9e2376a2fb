#!/usr/bin/env bash
# The figures of docs/pods.md's pre-flight table: for each of the papers' models, the largest
# per-core batch (a power of two) whose training step fits a slice's cores, in float32 and
# bfloat16 compute, data parallel and with FSDP over the 8 cores of each host (data parallel
# across hosts). Both meshes give every core the same program on a v3-8, v3-32 or v3-256.
# Needs libtpu (pip install -e '.[tpu]'); each cell compiles once that fits (one to four minutes
# on 2 CPU cores) after quick refusals. Usage: docs/preflight_table.sh [SLICE...] > table.log
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import vit_jax' 2>/dev/null || { echo "python cannot import vit_jax: activate the project's venv (. .venv/bin/activate)" >&2; exit 2; }
slices=("${@:-v3-8}")
models=("configs/vit.py:b16,imagenet2012" "configs/vit.py:l16,imagenet2012"
        "configs/vit.py:h14,imagenet2012" "configs/t2t.py:14" "configs/t2t.py:24")
dtypes=(bfloat16 float32)
# A subset: MODELS="configs/t2t.py:14 configs/t2t.py:24" DTYPES=bfloat16 docs/preflight_table.sh
[[ -z "${MODELS:-}" ]] || read -r -a models <<<"$MODELS"
[[ -z "${DTYPES:-}" ]] || read -r -a dtypes <<<"$DTYPES"
for accelerator in "${slices[@]}"; do
  for dtype in "${dtypes[@]}"; do
    for mesh in "" "--config.mesh.data=-1 --config.mesh.fsdp=8"; do
      for config in "${models[@]}"; do
        echo "=== $accelerator $config $dtype ${mesh:-data-parallel}"
        # shellcheck disable=SC2086  # $mesh is two flags or none
        python -m vit_jax.preflight --config "$config" --accelerator "$accelerator" \
          --config.model.dtype="$dtype" $mesh --config.total_steps=1000000 --largest_batch \
          --noeval 2>&1 |
          grep -E "per device:|Largest|DOES NOT|FATAL|^total|^temporaries" || true
      done
    done
  done
done
