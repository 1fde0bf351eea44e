#!/usr/bin/env bash
# Runs nccl_transport_check on two MPI ranks, one GPU each; both must report ok. With
# fewer than two GPUs the check prints GPIPE_TEST_SKIPPED (which ./gpipe test counts
# as skipped) and passes.
set -euo pipefail
bin="$1"
out="$(timeout 240 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" 2>&1)" || { echo "$out"; exit 1; }
echo "$out"
if grep -q "GPIPE_TEST_SKIPPED" <<< "$out"; then exit 0; fi
[ "$(grep -c 'nccl_transport_check: rank [01] ok' <<< "$out")" -eq 2 ]
