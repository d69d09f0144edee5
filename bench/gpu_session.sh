#!/usr/bin/env bash
# The GPU measurements in one go, inside one device call: every step shares one deadline
# (BUDGET seconds, default 540), the most important first, so a short lease still returns the
# engine checks and the layer timings. Run it from the repository root with the gpu extra
# installed (pip install -e '.[gpu]'), or with its packages on PYTHONPATH
# (bench/gpu_wheels.sh carries them to a machine with no network). Results go to $OUT
# (default /tmp/moetrain_gpu): versions.txt, session.log (every step's output) and records.jsonl
# (the JSON records, for bench/RESULTS.md "GPU: one H100").
#   bash bench/gpu_session.sh
#   SIZE=tiny bash bench/gpu_session.sh   # the same steps on small shapes: any machine, CPU too
# What it compares (bench/RESULTS.md has the earlier H100 record): XLA:GPU runs ragged_dot as a
# dense product over every expert unless its cuDNN grouped GEMM applies; tokamax's kernels
# (engine.moe_backend=tokamax, the GPU default where installed; Mosaic GPU or Triton, each record's
# tokamax_kernels says which ran per product) follow the group sizes; capacity buffers are the
# fast-but-dropping baseline.
# shellcheck disable=SC2086  # $PY, $MFU and $LAYER are split into words on purpose
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} MOETRAIN_NO_REEXEC=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/moetrain_gpu}
PY=${PY:-python3}
SIZE=${SIZE:-full}
DEADLINE=$((SECONDS + ${BUDGET:-540}))
mkdir -p "$OUT"
if [ "$SIZE" = tiny ]; then
  TOKENS=512; MFU="--preset tiny --seq 128 --steps 2"; CHECK_TOKENS=200
else
  TOKENS=16384; MFU="--steps 5"; CHECK_TOKENS=4000
fi

# step CAP CMD...: runs CMD for at most CAP seconds and never past the deadline (skipped when
# under 15 s are left); its output goes to session.log, its JSON records to records.jsonl.
step() {
  local cap=$1 left=$((DEADLINE - SECONDS))
  shift
  if [ "$left" -lt 15 ]; then
    echo "== skipped at the deadline: $*" | tee -a "$OUT/session.log"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $* (at most ${cap} s, at ${SECONDS} s)" | tee -a "$OUT/session.log"
  timeout "$cap" "$@" 2>&1 | tee -a "$OUT/session.log" | grep --line-buffered '^{' \
    >>"$OUT/records.jsonl"
  echo "== exit ${PIPESTATUS[0]}" | tee -a "$OUT/session.log"
}

# 1. What the machine has: versions, the GPU, cuDNN (XLA's grouped GEMM needs >= 9.22).
$PY - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md
import jax
versions = {}
for p in ('jax', 'jaxlib', 'jax-cuda13-plugin', 'flax', 'optax', 'tokamax', 'nvidia-cudnn-cu13',
          'nvidia-cudnn-cu12', 'triton', 'jax-triton'):
  try:
    versions[p] = md.version(p)
  except md.PackageNotFoundError:
    pass
print(versions, jax.devices(), [getattr(d, 'compute_capability', None) for d in jax.devices()])
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv \
  >>"$OUT/versions.txt" 2>&1
# 2. The GPU engine against the dense reference in bfloat16 (values and gradients, adapters
#    included, skewed loads with empty experts; ~55 s on an H200).
step 90 $PY -m bench.gpu_engine_check --dtype bfloat16 --tokens $CHECK_TOKENS
# 3. The MoE layer (forward + backward; frozen and trained experts) in bf16 against its ideal:
#    tokamax dropless, then capacity buffers for the side-by-side ratio (~100 s and ~70 s).
LAYER="$PY -m bench.moe_layer --dtype bfloat16 --tokens $TOKENS --repeats 5"
step 120 $LAYER --backend tokamax
step 100 $LAYER --dispatch capacity
# 4. MFU of the ~1B-active model at batch 2 (each size compiles for ~2 min on XLA:GPU), dropless
#    through the GPU engine and with capacity buffers.
step 180 $PY -m bench.mfu $MFU --dispatch dropless --batch 2
step 180 $PY -m bench.mfu $MFU --dispatch capacity --batch 2
# 5. While time is left: float32 (tokamax's Triton kernel or its XLA form), XLA's ragged_dot
#    layer (cuDNN where it applies, else dense), dropless at batch 1 and 4.
step 60 $PY -m bench.gpu_engine_check --dtype float32 --tokens $CHECK_TOKENS
step 100 $LAYER --backend ragged_dot
step 300 $PY -m bench.mfu $MFU --dispatch dropless --batch 1,4
echo "records in $OUT ($SECONDS s)"
