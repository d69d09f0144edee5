#!/usr/bin/env bash
# The GPU measurements in one go, under 9 minutes on an H100 or H200 (each step is capped; a
# 15-minute device lease includes the machine's start). Run it from the repository root with the
# gpu extra installed (pip install -e '.[gpu]'; it installs nothing itself). Results go to $OUT
# (default /tmp/moetrain_gpu), one log per step, each holding JSON records for bench/RESULTS.md
# ("GPU: one H100").
#   bash bench/gpu_session.sh
#   SIZE=tiny bash bench/gpu_session.sh   # the same steps on small shapes: any machine, CPU too
# What it compares (bench/RESULTS.md has the earlier H100 record): XLA:GPU runs ragged_dot as a
# dense product over every expert unless its cuDNN grouped GEMM applies; tokamax's kernels
# (model.moe_backend=tokamax, the GPU default where installed) follow the group sizes; capacity
# buffers are the fast-but-dropping baseline.
# shellcheck disable=SC2086  # $PY, $MFU and $args are split into words on purpose
set -uo pipefail
export PYTHONPATH=$PWD MOETRAIN_NO_REEXEC=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/moetrain_gpu}
PY=${PY:-python3}
SIZE=${SIZE:-full}
mkdir -p "$OUT"
if [ "$SIZE" = tiny ]; then
  TOKENS=512; MFU="--preset tiny --seq 128 --steps 2"; BATCHES=1,2; CHECK_TOKENS=200
else
  TOKENS=16384; MFU="--steps 5"; BATCHES=1,2,4; CHECK_TOKENS=4000
fi
# 1. What the machine has: versions, the GPU, cuDNN (XLA's grouped GEMM needs >= 9.22).
$PY - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md
import jax
versions = {}
for p in ('jax', 'jaxlib', 'flax', 'optax', 'tokamax', 'nvidia-cudnn-cu13', 'nvidia-cudnn-cu12', 'triton', 'jax-triton'):
  try:
    versions[p] = md.version(p)
  except md.PackageNotFoundError:
    pass
print(versions, jax.devices())
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv \
  >>"$OUT/versions.txt" 2>&1
# 2. A smoke run: does the training step compile and run at all?
timeout 120 $PY -m bench.mfu --preset tiny --batch 2 --seq 128 --steps 2 2>&1 \
  | tee "$OUT/smoke.log" || exit 1
# 3. The GPU engine against the dense reference (values and gradients, adapters included, skewed
#    loads with empty experts), in float32 and bfloat16.
for dtype in float32 bfloat16; do
  timeout 120 $PY -m bench.gpu_engine_check --dtype $dtype --tokens $CHECK_TOKENS 2>&1 \
    | tee "$OUT/engine_check_$dtype.log"
done
# 4. The MoE layer (forward + backward; frozen and trained experts) in bf16 for each engine
#    against its ideal: XLA's ragged_dot (cuDNN where it applies, else dense), tokamax, the
#    grouped loop, capacity buffers.
for args in "--backend ragged_dot" "--backend tokamax" "--backend grouped" "--dispatch capacity"; do
  name=$(echo "$args" | tr -d '-' | tr ' ' '_')
  timeout 100 $PY -m bench.moe_layer --dtype bfloat16 --tokens $TOKENS --repeats 5 $args 2>&1 \
    | tee "$OUT/moe_layer_$name.log"
done
# 5. MFU of the ~1B-active model (each size compiles for ~95 s on an H100): dropless through the
#    GPU engine at each batch, capacity at the middle one for the side-by-side ratio.
timeout 330 $PY -m bench.mfu $MFU --dispatch dropless --batch $BATCHES 2>&1 \
  | tee "$OUT/mfu_dropless.log"
timeout 130 $PY -m bench.mfu $MFU --dispatch capacity --batch 2 2>&1 \
  | tee "$OUT/mfu_capacity.log"
echo "records in $OUT"
