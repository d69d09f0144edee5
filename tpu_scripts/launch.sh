#!/usr/bin/env bash
# Run the same command on every worker of every slice: JAX forms one job across them.
#   TPU_NAME=moe ZONE=us-east5-a WORKDIR=/mnt/shared/runs/lora tpu_scripts/launch.sh \
#     --config=configs/longcat_lora.py:variant=flash --config.init.hf_checkpoint=/mnt/longcat
# WORKDIR  the run directory, shared by every worker (required for training)
# MODULE   a tool instead of training, e.g. MODULE=moetrain.tools.export ... --out=DIR
# Logs go to ~/<module>.log on each worker (tpu_scripts/status.sh tails them).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
require TPU_NAME ZONE
MODULE="${MODULE:-moetrain.main}"
if [[ "$MODULE" == moetrain.main ]]; then require WORKDIR; fi
cmd=(.venv/bin/python -m "$MODULE")
if [[ -n "${WORKDIR:-}" ]]; then cmd+=(--workdir="$WORKDIR"); fi
cmd+=("${ARGS[@]}")
printf -v line '%q ' "${cmd[@]}"
LOG="${MODULE##*.}.log"  # main.log for training, export.log for moetrain.tools.export, ...
on_all_workers "cd ~/moetrain && MOETRAIN_DISTRIBUTED=1 nohup ${line% } > ~/$LOG 2>&1 &"
if (( ! DRY_RUN )); then
  echo "Launched on all workers; follow it: tpu_scripts/status.sh (LOG=$LOG)"
fi
