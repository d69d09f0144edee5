#!/usr/bin/env bash
# The command of a TPU pod on GKE (the JobSet manifests and xpk commands that
# `python -m moetrain.tools.launch` writes), run from the image's working directory:
#   bash tpu_scripts/pod_run.sh --config=configs/longcat_lora.py:variant=flash --workdir=gs://...
# runs `python -m moetrain.main` with these arguments. A SIGTERM (node maintenance, a spot
# preemption, an eviction) is passed on to it: the run saves a checkpoint at its next step and
# stops. The pod then exits 143, not 0: its Job counts a failure and the JobSet restarts every
# pod, which resume from the run directory, instead of taking the stopped run for a finished one.
set -uo pipefail

child=''
stopped=0
# shellcheck disable=SC2329  # (the trap calls it)
pass_on_sigterm() {
  stopped=1
  echo 'pod_run.sh: SIGTERM passed on to the run (it saves a checkpoint, then stops)' >&2
  if [[ -n "$child" ]]; then kill -TERM "$child" 2>/dev/null; fi
}
trap pass_on_sigterm TERM

python -m moetrain.main "$@" &
child=$!
if (( stopped )); then kill -TERM "$child" 2>/dev/null; fi  # a SIGTERM before it started

wait "$child"
status=$?
# A wait cut short by the signal returns at once: wait again until the run has ended.
while (( stopped )) && kill -0 "$child" 2>/dev/null; do
  wait "$child"
  status=$?
done
if (( stopped && status == 0 )); then
  status=143
fi
exit "$status"
