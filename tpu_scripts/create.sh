#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice).
#   TPU_NAME=moe ZONE=us-east5-a ACCELERATOR=v5p-64 tpu_scripts/create.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${ACCELERATOR:=v5litepod-8}"
VERSION=${VERSION:-v2-alpha-tpuv5}
gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR" --version="$VERSION" ${SPOT:+--spot}
