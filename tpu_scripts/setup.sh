#!/usr/bin/env bash
# Copy this checkout to every worker of every slice and install moetrain with TPU JAX there.
# Rerun it to ship code changes (installed packages are kept).
#   TPU_NAME=moe ZONE=us-east5-a tpu_scripts/setup.sh [--dry_run]
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
require TPU_NAME ZONE
cd "$(dirname "$0")/.."
TARBALL="${TMPDIR:-/tmp}/moetrain.tgz"
run tar czf "$TARBALL" --exclude=.venv --exclude=runs --exclude=exports --exclude=.git .
qr scp "$TARBALL" "$TPU_NAME:~/" --node=all --worker=all
# JAX 0.12 needs Python >= 3.12; the TPU images (Ubuntu 22.04) have 3.10, so uv provides one.
# --allow-existing: a rerun keeps the installed packages (uv >= 0.8 refuses an existing .venv
# without it).
on_all_workers 'set -e
mkdir -p ~/moetrain && tar xzf ~/moetrain.tgz -C ~/moetrain && cd ~/moetrain
python3 -m pip install -q --user uv || curl -LsSf https://astral.sh/uv/install.sh | sh
~/.local/bin/uv venv -q --seed --allow-existing --python 3.12 .venv
~/.local/bin/uv pip install -q --python .venv/bin/python -e ".[tpu]"'
