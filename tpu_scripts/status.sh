#!/usr/bin/env bash
# The queued resource's state, and the last lines of the log on worker 0 of each slice.
#   TPU_NAME=moe ZONE=us-east5-a tpu_scripts/status.sh [--dry_run]
# LOG    which log (default main.log);  TAIL  how many lines (default 20)
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
require TPU_NAME ZONE
qr describe "$TPU_NAME" --format='value(state.state)'
qr ssh "$TPU_NAME" --node=all --worker=0 --command="tail -n ${TAIL:-20} ~/${LOG:-main.log}"
