#!/usr/bin/env bash
# Every GPU measurement (MoE layer, MFU) in one go, at most about 11 minutes on an H100 (each step is capped): run it on the GPU
# machine from the repository root with the JAX installed there (it installs nothing). Results go
# to $OUT (default /tmp/moetrain_gpu), one log per step; copy the JSON records into
# bench/RESULTS.md.
#   bash bench/gpu_session.sh
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
# 3. MFU of the ~1B-active model with the default (dropless, ragged_dot) dispatch, batch 1, 2, 4 x
#    4096 tokens: the number this script is for comes first, in case the lease runs out.
timeout 240 $PY -m bench.mfu --dispatch dropless --batch 1,2,4 --steps 5 2>&1 | tee "$OUT/mfu_dropless.log"
# 4. The MoE layer in bf16: ragged_dot (the GPU default) against capacity buffers. A ratio near
#    the expert count (16) would mean XLA runs ragged_dot as a dense matmul over every expert.
for dispatch in dropless capacity; do
  timeout 100 $PY -m bench.moe_layer --dtype bfloat16 --tokens 16384 --repeats 5 \
    --dispatch "$dispatch" 2>&1 | tee "$OUT/moe_layer_$dispatch.log"
done
# 5. MFU with capacity buffers, for the side-by-side ratio.
timeout 180 $PY -m bench.mfu --dispatch capacity --batch 1,2 --steps 5 2>&1 | tee "$OUT/mfu_capacity.log"
