#!/usr/bin/env bash
# Stop the job on every worker, saved: SIGTERM makes moetrain save a checkpoint at one step on
# every host and exit (as on a preemption); a rerun of launch.sh resumes from it.
#   TPU_NAME=moe ZONE=us-east5-a tpu_scripts/stop.sh [--dry_run]
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
require TPU_NAME ZONE
on_all_workers "pkill -TERM -f 'python -m ${MODULE:-moetrain.main}' || true"
