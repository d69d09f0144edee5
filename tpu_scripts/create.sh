#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice).
#   TPU_NAME=moe ZONE=us-east5-a ACCELERATOR=v5p-64 tpu_scripts/create.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${ACCELERATOR:=v5litepod-8}"
# The TPU software version that matches the accelerator (cloud.google.com/tpu/docs/runtimes).
case "$ACCELERATOR" in
  v5litepod-*) DEFAULT_VERSION=v2-alpha-tpuv5-lite ;;
  v5p-*) DEFAULT_VERSION=v2-alpha-tpuv5 ;;
  v6e-*) DEFAULT_VERSION=v2-alpha-tpuv6e ;;
  *) DEFAULT_VERSION=tpu-ubuntu2204-base ;;  # v2, v3, v4
esac
VERSION=${VERSION:-$DEFAULT_VERSION}
gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR" --version="$VERSION" ${SPOT:+--spot}
