#!/usr/bin/env bash
# The GPU measurements in one go, about 9 minutes on an H100 (each step is capped; a 15-minute
# device lease includes the machine's start): run it on the GPU machine from the repository root
# with the JAX installed there (it installs nothing). Results go to $OUT (default
# /tmp/moetrain_gpu), one log per step; copy the JSON records into bench/RESULTS.md.
#   bash bench/gpu_session.sh
# The first H100 run measured the default (dropless through jax.lax.ragged_dot) and capacity dispatch on
# an H100 (bench/RESULTS.md): XLA:GPU runs ragged_dot as a dense product over every expert. This
# script now measures the dropless alternative first, the grouped engine (a loop over each
# expert's row tiles: its work follows the routed rows), beside those two.
set -uo pipefail
export PYTHONPATH=$PWD MOETRAIN_NO_REEXEC=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/moetrain_gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
# 1. What the machine has (the repo is pinned to jax 0.10 / flax 0.12; the image may differ).
$PY -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())" \
  2>&1 | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >>"$OUT/versions.txt" 2>&1
# 2. A smoke run: does the training step compile and run at all on this JAX?
timeout 120 $PY -m bench.mfu --preset tiny --batch 2 --seq 128 --steps 2 2>&1 | tee "$OUT/smoke.log" || exit 1
# 3. The MoE layer in bf16, dropless through ragged_dot and through the grouped engine, and with
#    capacity buffers; side by side in one process each.
for args in "--dispatch dropless" "--dispatch dropless --backend grouped" "--dispatch capacity"; do
  name=$(echo "$args" | tr -d '-' | tr ' ' '_')
  timeout 100 $PY -m bench.moe_layer --dtype bfloat16 --tokens 16384 --repeats 5 $args 2>&1 \
    | tee "$OUT/moe_layer_$name.log"
done
# 4. MFU of the ~1B-active model, 1 and 2 rows of 4096 tokens (each size compiles for ~95 s):
#    the grouped engine, then ragged_dot for the side-by-side ratio.
timeout 240 $PY -m bench.mfu --dispatch dropless --backend grouped --batch 1,2 --steps 5 2>&1 \
  | tee "$OUT/mfu_grouped.log"
timeout 130 $PY -m bench.mfu --dispatch dropless --batch 1 --steps 5 2>&1 | tee "$OUT/mfu_ragged_dot.log"
