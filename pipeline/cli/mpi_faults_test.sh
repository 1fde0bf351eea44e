#!/usr/bin/env bash
# Faults in multi-process runs, with real processes and real signals. Each is judged by
# the job's exit status and what it printed, inside a generous outer timeout (a job
# still running after it has hung: `timeout` answers 124), never by how fast it ended:
#  1. rank 0 (the stage that reports) killed with SIGKILL mid-run;
#  2. a rank that fails with an error the others cannot see (a token id in the data
#     that only stage 0's embedding rejects) ends the job with that rank's message;
#  3. a loss that becomes NaN (a huge learning rate) ends the job with the message;
#  4. a replica killed while the other waits for it in the gradient all-reduce: the
#     replica is stopped (SIGSTOP) mid-step, so its partner runs on into the step's
#     next collective with it and blocks there, then killed (SIGKILL); three times, at
#     different moments, with all gradients in one large bucket;
#  5. a replica of a K = 2 x D = 2 job killed outright mid-run.
set -uo pipefail
gpipe="$1"
tmp="${TEST_TMPDIR:-/tmp}/mpi_faults"
mkdir -p "$tmp"
mpirun=(timeout 120 mpirun --allow-run-as-root --oversubscribe)

# pid_of TAG RANK: the process of MPI rank RANK among those whose command line has TAG.
pid_of() {
  local p
  for p in $(pgrep -f -- "$1"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$p"
      return 0
    fi
  done
  return 1
}
# wait_for_steps LOG N: until the log shows N steps (at most a minute; the job is slow, not wrong).
wait_for_steps() {
  local _
  for _ in $(seq 600); do
    [ "$(grep -c '^step ' "$1" 2>/dev/null)" -ge "$2" ] && return 0
    sleep 0.1
  done
  cat "$1"; echo "FAIL: no training progress in $1"; exit 1
}
# ended_by_failure NAME RC: the job ended (not hung) and reported a failure.
ended_by_failure() {
  if [ "$2" -eq 124 ]; then cat "$tmp/$1.log"; echo "FAIL: $1: the job hung (killed by the outer timeout)"; exit 1; fi
  if [ "$2" -eq 0 ]; then cat "$tmp/$1.log"; echo "FAIL: $1: the job exited 0"; exit 1; fi
}

cat > "$tmp/mlp.yaml" <<EOF
model:
  input: [64]
  layers:
    - {type: linear, out: 256}
    - {type: relu}
    - {type: linear, out: 256}
    - {type: relu}
    - {type: linear, out: 256}
    - {type: relu}
    - {type: linear, out: 8}
  loss: {type: softmax_cross_entropy}
data: {type: teacher, classes: 8, eval_samples: 64}
pipeline: {partitions: 2, micro_batches: 4}
optimizer: {type: sgd, lr: 0.01, momentum: 0.9}
train: {steps: 1000000, batch_size: 64, log_interval: 1}
EOF

# 1. Rank 0 killed.
tag="$tmp/rank0"
"${mpirun[@]}" -np 2 "$gpipe" train "$tmp/mlp.yaml" --set output.dir="$tag" > "$tmp/rank0.log" 2>&1 &
job=$!
wait_for_steps "$tmp/rank0.log" 3
victim="$(pid_of "$tag" 0)" || { cat "$tmp/rank0.log"; kill "$job"; echo "FAIL: rank 0 not found"; exit 1; }
kill -9 "$victim"
wait "$job"
rc=$?
ended_by_failure rank0 "$rc"
grep -q "rank 0 .*exited on signal 9" "$tmp/rank0.log" ||
  { cat "$tmp/rank0.log"; echo "FAIL: the console does not say that rank 0 was killed"; exit 1; }
[ ! -e "$tag/report.json" ] || { echo "FAIL: a killed run left a report.json"; exit 1; }
echo "ok: killing rank 0 ends the job (rc=$rc) and says so"

# 2. One rank's error: a token id (280) that only stage 0's embedding (vocabulary 256)
# rejects; stage 1 only sees activations and would wait for ever.
escapes=""
for i in $(seq 0 2999); do  # little-endian uint16 ids
  id=$(( i == 1500 ? 280 : (i * 37) % 250 ))
  printf -v e '\\x%02x\\x%02x' $((id % 256)) $((id / 256))
  escapes+="$e"
done
printf "$escapes" > "$tmp/tokens.bin"
[ "$(stat -c %s "$tmp/tokens.bin")" -eq 6000 ] || { echo "FAIL: could not write the token file"; exit 1; }
cat > "$tmp/tokens.yaml" <<EOF
model:
  input: [16]
  layers:
    - {type: embedding, vocab: 256, dim: 16}
    - {type: transformer_block, heads: 2}
    - {type: layernorm}
    - {type: linear, out: 300}
  loss: {type: softmax_cross_entropy}
data: {type: tokens, path: $tmp/tokens.bin, vocab: 300, seq_len: 16, validation_fraction: 0.1}
pipeline: {partitions: 2, micro_batches: 2, balance: [3, 1]}
optimizer: {type: adam, lr: 0.001}
train: {steps: 400, batch_size: 8, log_interval: 1}
EOF
"${mpirun[@]}" -np 2 "$gpipe" train "$tmp/tokens.yaml" --set output.dir="$tmp/tokens" > "$tmp/tokens.log" 2>&1
rc=$?
ended_by_failure tokens "$rc"
grep -q "rank 0 ends the job: stage 0 failed: token id 280 at (b=.*) is outside the vocabulary \[0, 256); make the embedding's vocab option larger" "$tmp/tokens.log" ||
  { cat "$tmp/tokens.log"; echo "FAIL: stage 0's message is not on the console"; exit 1; }
echo "ok: a bad token seen only by stage 0 ends the job (rc=$rc) with stage 0's message"

# 3. A NaN loss: every rank sees it; the job ends with the message and the fix. (The
# highest learning rate the config allows, 10, with momentum 0.9 gives NaN at step 4.)
"${mpirun[@]}" -np 2 "$gpipe" train "$tmp/mlp.yaml" --set optimizer.lr=10 --set model.dtype=float32 \
  --set output.dir="$tmp/nan" > "$tmp/nan.log" 2>&1
rc=$?
ended_by_failure nan "$rc"
grep -qE "gpipe: error on rank [01]: the loss became (NaN|infinite) at step [0-9]+; lower optimizer.lr \(now 10\)" "$tmp/nan.log" ||
  { cat "$tmp/nan.log"; echo "FAIL: the NaN message is not on the console"; exit 1; }
[ ! -e "$tmp/nan/report.json" ] || { echo "FAIL: a diverged run left a report.json"; exit 1; }
echo "ok: a NaN loss under mpirun ends the job (rc=$rc) with the message"

# 4. A replica killed while its partner waits for it in the all-reduce: K = 1 x D = 2,
# 1.2 MB of float64 gradients in one bucket, and batches of 1024 so that most of a step
# is compute. Rank 1 is stopped, most likely in its forward or backward; rank 0 then
# finishes its own backward and blocks in the gradient reduction (GradReducer::finish;
# otherwise in the step's scalar all-reduce) until rank 1 dies. (Attaching gdb to rank 0
# during the second's wait showed it in MPI_Waitall under GradReducer::finish in most
# tries.)
for delay in 0.2 0.6 1.0; do
  tag="$tmp/replica_$delay"
  "${mpirun[@]}" -np 2 "$gpipe" train "$tmp/mlp.yaml" --set pipeline.partitions=1 --set pipeline.replicas=2 \
    --set pipeline.bucket_mb=1000 --set model.dtype=float64 --set train.batch_size=1024 \
    --set output.dir="$tag" > "$tag.log" 2>&1 &
  job=$!
  wait_for_steps "$tag.log" 2
  sleep "$delay"
  victim="$(pid_of "$tag" 1)" || { cat "$tag.log"; kill "$job"; echo "FAIL: rank 1 not found"; exit 1; }
  kill -STOP "$victim"
  sleep 1
  kill -9 "$victim"
  wait "$job"
  rc=$?
  ended_by_failure "replica_$delay" "$rc"
  grep -q "rank 1 .*exited on signal 9" "$tag.log" || { cat "$tag.log"; echo "FAIL: the console does not name rank 1"; exit 1; }
  echo "ok: replica 1 stopped and killed mid-step (after ${delay}s) ends the K=1 x D=2 job (rc=$rc)"
done

# 5. A replica of a K = 2 x D = 2 job (rank 3: stage 1 of replica 1) killed mid-run.
tag="$tmp/k2d2"
"${mpirun[@]}" -np 4 "$gpipe" train "$tmp/mlp.yaml" --set pipeline.replicas=2 --set pipeline.bucket_mb=0.1 \
  --set output.dir="$tag" > "$tag.log" 2>&1 &
job=$!
wait_for_steps "$tag.log" 3
victim="$(pid_of "$tag" 3)" || { cat "$tag.log"; kill "$job"; echo "FAIL: rank 3 not found"; exit 1; }
kill -9 "$victim"
wait "$job"
rc=$?
ended_by_failure k2d2 "$rc"
grep -q "rank 3 .*exited on signal 9" "$tag.log" || { cat "$tag.log"; echo "FAIL: the console does not name rank 3"; exit 1; }
echo "ok: killing rank 3 of K=2 x D=2 ends the job (rc=$rc)"
