#!/usr/bin/env bash
# Delete the queued resource and its slices (billing stops; the run directory, on shared
# storage, stays). Stop the job first (stop.sh) to keep its last steps.
#   TPU_NAME=moe ZONE=us-east5-a tpu_scripts/delete.sh [--dry_run]
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
require TPU_NAME ZONE
qr delete "$TPU_NAME" --force --quiet
