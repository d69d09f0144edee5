#!/usr/bin/env bash
# Copy this checkout to every worker of the TPU VM and install moetrain with TPU JAX.
#   TPU_NAME=moe ZONE=us-east5-a tpu_scripts/setup.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
cd "$(dirname "$0")/.."
tar czf /tmp/moetrain.tgz --exclude=.venv --exclude=runs --exclude=.git .
gcloud compute tpus tpu-vm scp /tmp/moetrain.tgz "$TPU_NAME":~/ --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command='
  mkdir -p ~/moetrain && tar xzf ~/moetrain.tgz -C ~/moetrain && cd ~/moetrain &&
  python3 -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e ".[tpu]"'
