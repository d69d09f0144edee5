#!/usr/bin/env bash
# Copy this checkout to every worker of the TPU VM and install moetrain with TPU JAX.
#   TPU_NAME=moe ZONE=us-east5-a tpu_scripts/setup.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
cd "$(dirname "$0")/.."
tar czf /tmp/moetrain.tgz --exclude=.venv --exclude=runs --exclude=exports --exclude=.git .
gcloud compute tpus tpu-vm scp /tmp/moetrain.tgz "$TPU_NAME":~/ --zone="$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command='
  set -e
  mkdir -p ~/moetrain && tar xzf ~/moetrain.tgz -C ~/moetrain && cd ~/moetrain
  # JAX 0.10 needs Python >= 3.11; the TPU images (Ubuntu 22.04) have 3.10, so uv provides one.
  python3 -m pip install -q --user uv || curl -LsSf https://astral.sh/uv/install.sh | sh
  # --allow-existing: a rerun (to copy new code) keeps the installed packages; uv >= 0.8 refuses
  # an existing .venv without it (or --clear).
  ~/.local/bin/uv venv -q --seed --allow-existing --python 3.11 .venv
  ~/.local/bin/uv pip install -q --python .venv/bin/python -e ".[tpu]"'
