#!/usr/bin/env bash
# Run the same training command on every worker (JAX forms one multi-host job).
#   TPU_NAME=moe ZONE=us-east5-a WORKDIR=/mnt/shared/runs/lora tpu_scripts/launch.sh \
#     --config=configs/longcat_lora.py:variant=flash --config.init.hf_checkpoint=/mnt/longcat
# MODULE runs a tool the same way, e.g. MODULE=moetrain.tools.export ... --out=/mnt/shared/merged
set -euo pipefail
MODULE="${MODULE:-moetrain.main}"
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
if [[ "$MODULE" == moetrain.main ]]; then
  : "${WORKDIR:?set WORKDIR (a filesystem path every worker shares)}"
fi
# A tool may go without a run (evaluate or generate a base checkpoint: --config ... --config.init.hf_checkpoint=DIR).
ARGS=$(printf ' %q' "$@")
if [[ -n "${WORKDIR:-}" ]]; then
  ARGS=" --workdir=$(printf %q "$WORKDIR")$ARGS"
fi
LOG="${MODULE##*.}.log"  # main.log for training, export.log for moetrain.tools.export, ...
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd ~/moetrain && MOETRAIN_DISTRIBUTED=1 nohup .venv/bin/python -m $(printf %q "$MODULE") \
    $ARGS > ~/$LOG 2>&1 &"
echo "Launched on all workers; logs: gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=0 --command='tail -f ~/$LOG'"
