#!/usr/bin/env bash
# Runs nccl_transport_check on two MPI ranks, one GPU each; both must report ok. Then,
# for each kind of host wait on NCCL work (a send's completion, a receive's arrival, a
# replica all-reduce, a tensor group's sum), rank 1 stops taking part and rank 0's wait must end the job after
# pipeline.timeout_s (2 s) with exit status 75 (kTimeoutExitCode) and a message naming
# what it waited for. The outer `timeout` only keeps a regression from hanging CI; no
# duration is asserted. With fewer than two GPUs the check prints GPIPE_TEST_SKIPPED
# (which ./gpipe test counts as skipped) and passes.
set -uo pipefail
bin="$1"
fail() { echo "FAIL: $*"; exit 1; }
out="$(timeout -k 5 240 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" 2>&1)" || { echo "$out"; fail "the test cases"; }
echo "$out"
if grep -q "GPIPE_TEST_SKIPPED" <<< "$out"; then exit 0; fi
[ "$(grep -c 'nccl_transport_check: rank [01] ok' <<< "$out")" -eq 2 ] || fail "not both ranks reported ok"

declare -A expect=(
  [send]="rank 0 (stage 0) waited 2 s for the activation of micro-batch 3 to rank 1 to be received (ncclSend) at step 12"
  [recv]="rank 0 (stage 0) waited 2 s for the activation of micro-batch 4 from rank 1 (ncclRecv) at step 12"
  [replica]="rank 0 waited 2 s for the last of 1 collective(s) over the stage's replicas (2 ranks; ncclAllReduce, ncclReduceScatter or ncclAllGather) at step 12"
  [tensor]="rank 0 waited 2 s for the last of 1 collective(s) over the stage's tensor group (2 ranks; ncclAllReduce, ncclReduceScatter or ncclAllGather) at step 12"
)
for mode in send recv replica tensor; do
  log="$(timeout -k 5 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" --stuck="$mode" 2>&1)"
  rc=$?
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || { echo "$log"; fail "$mode: the job hung (ended by the outer timeout)"; }
  [ "$rc" -eq 75 ] || { echo "$log"; fail "$mode: exit status $rc, expected 75 (kTimeoutExitCode)"; }
  grep -qF "${expect[$mode]}" <<< "$log" || { echo "$log"; fail "$mode: expected '${expect[$mode]}'"; }
  grep -qF "pipeline.timeout_s is 2" <<< "$log" || { echo "$log"; fail "$mode: the message does not name pipeline.timeout_s"; }
  echo "$mode: ended with status $rc: $(grep -F 'waited 2 s' <<< "$log" | head -1)"
done
echo "nccl_transport_test: ok"
