#!/usr/bin/env bash
# A rank that is alive but stuck (kill -STOP) must not hang an MPI job: for each kind of
# wait (a receive, the completion of a send, the pipeline's all-reduce and gather, a
# replica group's started all-reduces), the other rank gives up after pipeline.timeout_s
# (2 s here), logs what it waited for, and the job ends with kTimeoutExitCode (75). The
# outer `timeout` only keeps a regression from hanging CI; no duration is asserted.
#   mpi_timeout_test.sh CHECK_BINARY
set -uo pipefail
bin="$1"
work="${TEST_TMPDIR:-$(mktemp -d)}/mpi_timeout"
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }

declare -A expect=(
  [recv]="waited 2 s for the activation of micro-batch 3 from rank 1 (its header, MPI_Irecv) at step 12"
  [flush]="waited 2 s for the gradient of micro-batch 5 to rank 1 to be sent"
  [allreduce]="waited 2 s for the all-reduce of a scalar over the pipeline's 2 ranks"
  [gather]="waited 2 s for the gather of report values to rank 0"
  [replica]="waited 2 s for 1 started gradient all-reduce(s) over the stage's 2 replicas"
)
for mode in recv flush allreduce gather replica; do
  log="$work/$mode.log"
  : > "$log"
  timeout -k 5 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" "$mode" 2 > "$log" 2>&1 &
  job=$!
  pid1=""
  for _ in $(seq 1200); do
    pid1=$(sed -n 's/^mpi_timeout_check: rank 1 pid \([0-9]*\) ready$/\1/p' "$log")
    [ -n "$pid1" ] && break
    sleep 0.05
  done
  [ -n "$pid1" ] || { cat "$log"; kill "$job"; fail "$mode: rank 1 never started"; }
  kill -STOP "$pid1"
  wait "$job"
  rc=$?
  kill -CONT "$pid1" 2>/dev/null; kill -9 "$pid1" 2>/dev/null
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || { cat "$log"; fail "$mode: the job hung (ended by the outer timeout)"; }
  [ "$rc" -eq 75 ] || { cat "$log"; fail "$mode: exit status $rc, expected 75 (kTimeoutExitCode)"; }
  grep -qF "rank 0 (stage 0) waited" "$log" || grep -qF "rank 0 waited" "$log" || { cat "$log"; fail "$mode: no rank named"; }
  grep -qF "${expect[$mode]}" "$log" || { cat "$log"; fail "$mode: expected '${expect[$mode]}'"; }
  grep -qF "pipeline.timeout_s is 2" "$log" || { cat "$log"; fail "$mode: the message does not name pipeline.timeout_s"; }
  echo "$mode: ended with status $rc: $(grep -F 'waited 2 s' "$log" | head -1)"
done
echo "mpi_timeout_test: ok"
