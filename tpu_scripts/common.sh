# shellcheck shell=bash
# Shared by the slice scripts (sourced): settings from the environment, --dry_run, the runner.
#   TPU_NAME   the queued resource, and its node (one slice) or node prefix (NUM_SLICES > 1:
#              nodes TPU_NAME-0 ... TPU_NAME-<n-1>)
#   ZONE       e.g. us-east5-a;  PROJECT  default: gcloud's configured project
#   NUM_SLICES slices of the queued resource (multislice over DCN), default 1
# --dry_run (anywhere in the arguments) prints the gcloud commands instead of running them, one
# per line, shell-quoted: what a test checks, and what a careful user reads first.

DRY_RUN=0
ARGS=()
for arg in "$@"; do
  if [[ "$arg" == --dry_run ]]; then DRY_RUN=1; else ARGS+=("$arg"); fi
done
NUM_SLICES="${NUM_SLICES:-1}"

require() {  # require VAR...: stop with a message naming the first unset one
  local name
  for name in "$@"; do
    if [[ -z "${!name:-}" ]]; then
      echo "error: set $name (see the comment at the top of $0)" >&2
      exit 2
    fi
  done
}

quote() {  # quote WORD: WORD as a POSIX shell reads it back (single quotes where needed)
  if [[ "$1" =~ ^[A-Za-z0-9_./=:@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

run() {  # run CMD ARGS...: runs it, or with --dry_run prints it
  if (( DRY_RUN )); then
    local word line=''
    for word in "$@"; do line+="$(quote "$word") "; done
    echo "${line% }"
  else
    "$@"
  fi
}

qr() {  # qr VERB ARGS...: gcloud's queued-resources VERB on TPU_NAME in ZONE (and PROJECT)
  local verb="$1"
  shift
  local where=(--zone="$ZONE")
  if [[ -n "${PROJECT:-}" ]]; then where+=(--project="$PROJECT"); fi
  run gcloud compute tpus queued-resources "$verb" "$@" "${where[@]}"
}

on_all_workers() {  # on_all_workers COMMAND: runs COMMAND on every worker of every slice
  qr ssh "$TPU_NAME" --node=all --worker=all --command="$1"
}
