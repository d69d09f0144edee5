#!/usr/bin/env bash
# Request TPU slices as a queued resource, then wait until it is ACTIVE (capacity is granted
# when it frees up: minutes to hours; spot slices can be taken back, training resumes).
#   TPU_NAME=moe ZONE=us-east5-a ACCELERATOR=v5p-64 tpu_scripts/create.sh [--dry_run]
# ACCELERATOR  v4-N, v5litepod-N (or v5e-N), v5p-N, v6e-N; other types need VERSION
# VERSION      the TPU runtime (cloud.google.com/tpu/docs/runtimes); default by generation
# SPOT=1       spot capacity (cheaper, preemptible);  RESERVED=1  your reservation
# NUM_SLICES=N multislice: N slices of ACCELERATOR joined over the data-center network (train
#              with --config.mesh.dcn_shape putting an axis across them)
# WAIT=0       return once queued;  POLL  seconds between state checks (default 30)
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
require TPU_NAME ZONE ACCELERATOR
ACCELERATOR="${ACCELERATOR/#v5e-/v5litepod-}"  # gcloud's name for v5e
case "$ACCELERATOR" in
  v4-*) known=tpu-ubuntu2204-base ;;
  v5litepod-*) known=v2-alpha-tpuv5-lite ;;
  v5p-*) known=v2-alpha-tpuv5 ;;
  v6e-*) known=v2-alpha-tpuv6e ;;
  *) known= ;;
esac
VERSION="${VERSION:-$known}"
if [[ -z "$VERSION" ]]; then
  echo "error: set VERSION for ACCELERATOR=$ACCELERATOR: this script knows the runtimes of" \
    "v4, v5litepod (v5e), v5p and v6e only (see cloud.google.com/tpu/docs/runtimes)" >&2
  exit 2
fi
if [[ -n "${SPOT:-}" && -n "${RESERVED:-}" ]]; then
  echo "error: SPOT and RESERVED exclude each other: set one" >&2
  exit 2
fi
flags=(--accelerator-type="$ACCELERATOR" --runtime-version="$VERSION")
if (( NUM_SLICES > 1 )); then
  flags+=(--node-count="$NUM_SLICES" --node-prefix="$TPU_NAME")
else
  flags+=(--node-id="$TPU_NAME")
fi
if [[ -n "${SPOT:-}" ]]; then flags+=(--spot); fi
if [[ -n "${RESERVED:-}" ]]; then flags+=(--reserved); fi
qr create "$TPU_NAME" "${flags[@]}"

if [[ "${WAIT:-1}" == 0 ]]; then exit 0; fi
if (( DRY_RUN )); then
  qr describe "$TPU_NAME" --format='value(state.state)'
  echo "# (repeated every ${POLL:-30} s until the state is ACTIVE; FAILED or SUSPENDED stop it)"
  exit 0
fi
while true; do
  state=$(qr describe "$TPU_NAME" --format='value(state.state)')
  case "$state" in
    ACTIVE) echo "$TPU_NAME is ACTIVE: next, tpu_scripts/setup.sh"; break ;;
    FAILED | SUSPENDED)
      echo "error: queued resource $TPU_NAME is $state:" \
        "gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE" >&2
      exit 1 ;;
    *) echo "$(date +%T) $TPU_NAME: $state"; sleep "${POLL:-30}" ;;
  esac
done
