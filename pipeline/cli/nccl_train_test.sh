#!/usr/bin/env bash
# An NCCL training run under mpirun against the same run as threads of one process:
#  1. `mpirun -np 2 gpipe train` with pipeline.devices [cuda, cuda] (one GPU per rank,
#     NCCL between them, warmed-up connections, receives on their own stream) logs the
#     per-step losses and the validation of one process running the two stages as
#     threads on cuda:0 and cuda:1 (peer copies), to float32 rounding;
#  2. K = 1 x T = 2 (tensor parallelism: each rank a GPU, the head and its loss split by
#     the classes, the group's sums by NCCL on the devices) logs one GPU's losses, and so
#     does configs/gpt.yaml at K = 1 x T = 2 with sequence parallelism;
#  3. with four GPUs, K = 2 x D = 2 (NCCL all-reduce between replicas, ordered against
#     the pipeline's sends and receives) and K = 2 x T = 2 (each stage's tensor group on
#     NCCL beside the pipeline's transfers) log the single-process losses too.
# Prints GPIPE_TEST_SKIPPED (counted as skipped by ./gpipe test) and passes with fewer
# than two GPUs.
set -uo pipefail
gpipe="$1"
config="$2"
devices_bin="$3"
tmp="${TEST_TMPDIR:-/tmp}"
gpus="$("$devices_bin")"
if [ "${gpus:-0}" -lt 2 ]; then
  echo "GPIPE_TEST_SKIPPED: needs two GPUs, $gpus visible"
  exit 0
fi
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
common=(--set train.steps=12 --set train.log_interval=1 --set train.eval_interval=6 --set data.eval_samples=256)

losses() { grep -E '^step ' | awk '{print $2, $4}'; }
validation() { grep -oE 'val_loss [0-9.]+|Validation: loss [0-9.]+' | awk '{print $NF}'; }
# Columns: step, loss here, loss there; relative difference within float32 rounding.
close_enough() {
  awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-4 * ($2 < 0 ? -$2 : $2) + 1e-6) { print "step " $1 ": " $2 " vs " $4; bad = 1 } } END { exit bad }' "$1"
}
# same_losses REF RUN STEPS WHAT: RUN's log has STEPS step lines, each within float32
# rounding of REF's.
same_losses() {
  paste <(losses < "$tmp/$1.log") <(losses < "$tmp/$2.log") > "$tmp/$2_pairs.txt"
  [ "$(wc -l < "$tmp/$2_pairs.txt")" -eq "$3" ] || { cat "$tmp/$2.log"; echo "FAIL: expected $3 step lines"; exit 1; }
  close_enough "$tmp/$2_pairs.txt" || { echo "FAIL: per-step losses differ: $4"; exit 1; }
}

"$gpipe" train "$config" "${common[@]}" --set 'pipeline.devices=[cuda:0,cuda:1]' --set output.dir="$tmp/threads" \
  > "$tmp/threads.log" 2>&1 || { cat "$tmp/threads.log"; echo "FAIL: one process, stages on cuda:0 and cuda:1"; exit 1; }
"${mpirun[@]}" -np 2 "$gpipe" train "$config" "${common[@]}" --set 'pipeline.devices=[cuda,cuda]' \
  --set output.dir="$tmp/nccl" > "$tmp/nccl.log" 2>&1 ||
  { cat "$tmp/nccl.log"; echo "FAIL: mpirun -np 2 with NCCL"; exit 1; }
same_losses threads nccl 12 "between threads and NCCL ranks"
echo "ok: 12 per-step losses agree between 2 threads on 2 GPUs and 2 NCCL ranks"
paste <(validation < "$tmp/threads.log" | nl) <(validation < "$tmp/nccl.log" | nl) > "$tmp/val.txt"
[ "$(wc -l < "$tmp/val.txt")" -eq 3 ] && close_enough "$tmp/val.txt" ||
  { cat "$tmp/val.txt"; echo "FAIL: validation differs between threads and NCCL ranks"; exit 1; }
echo "ok: the same validation loss with threads and with NCCL ranks"

# Tensor parallelism on two GPUs: K=1 x T=2, each rank its GPU, the head and its loss
# split by the classes, the group's sums by NCCL on the devices, against one process on
# one GPU.
"$gpipe" train "$config" "${common[@]}" --set 'pipeline.devices=[cuda:0]' --set pipeline.partitions=1 \
  --set output.dir="$tmp/one" > "$tmp/one.log" 2>&1 || { cat "$tmp/one.log"; echo "FAIL: one process on cuda:0"; exit 1; }
"${mpirun[@]}" -np 2 "$gpipe" train "$config" "${common[@]}" --set 'pipeline.devices=[cuda]' --set pipeline.partitions=1 \
  --set pipeline.tensor_parallel=2 --set output.dir="$tmp/tp" > "$tmp/tp.log" 2>&1 ||
  { cat "$tmp/tp.log"; echo "FAIL: mpirun -np 2 with pipeline.tensor_parallel=2 on two GPUs"; exit 1; }
same_losses one tp 12 "between one GPU and T=2 on two GPUs"
echo "ok: K=1 x T=2 on two GPUs gives the one-GPU losses"

# Sequence parallelism on two GPUs (a language model: its positions split between the
# members, all-gathered and reduce-scattered by NCCL, the shares moved by
# transpose_blocks on the devices), against the whole model on one GPU.
gpt="$(dirname "$config")/gpt.yaml"
lm=(--set train.steps=6 --set train.log_interval=1 --set train.eval_interval=0 --set pipeline.partitions=1)
"$gpipe" train "$gpt" "${lm[@]}" --set 'pipeline.devices=[cuda:0]' --set output.dir="$tmp/lm1" > "$tmp/lm1.log" 2>&1 ||
  { cat "$tmp/lm1.log"; echo "FAIL: the language model on cuda:0"; exit 1; }
"${mpirun[@]}" -np 2 "$gpipe" train "$gpt" "${lm[@]}" --set 'pipeline.devices=[cuda]' --set pipeline.tensor_parallel=2 \
  --set pipeline.sequence_parallel=true --set output.dir="$tmp/lmsp" > "$tmp/lmsp.log" 2>&1 ||
  { cat "$tmp/lmsp.log"; echo "FAIL: mpirun -np 2 with sequence parallelism on two GPUs"; exit 1; }
same_losses lm1 lmsp 6 "between one GPU and T=2 with sequence parallelism"
echo "ok: K=1 x T=2 with sequence parallelism on two GPUs gives the one-GPU losses"

if [ "$gpus" -lt 4 ]; then
  echo "ok: K=2 x D=2 skipped: needs four GPUs, $gpus visible"
  exit 0
fi
"${mpirun[@]}" -np 4 "$gpipe" train "$config" "${common[@]}" --set 'pipeline.devices=[cuda,cuda]' \
  --set pipeline.replicas=2 --set pipeline.bucket_mb=0.3 --set output.dir="$tmp/dp" > "$tmp/dp.log" 2>&1 ||
  { cat "$tmp/dp.log"; echo "FAIL: mpirun -np 4 with 2 replicas over NCCL"; exit 1; }
paste <(losses < "$tmp/threads.log") <(losses < "$tmp/dp.log") > "$tmp/dp_pairs.txt"
[ "$(wc -l < "$tmp/dp_pairs.txt")" -eq 12 ] || { cat "$tmp/dp.log"; echo "FAIL: expected 12 step lines"; exit 1; }
# Replicas sum their halves' gradients in another order: float32 rounding, looser.
if ! awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-3) { print "step " $1 ": " $2 " vs " $4; bad = 1 } } END { exit bad }' "$tmp/dp_pairs.txt"; then
  echo "FAIL: per-step losses differ between one process and K=2 x D=2 over NCCL"; exit 1
fi
echo "ok: K=2 x D=2 over NCCL gives the single-process losses"

# Both levels on NCCL: K=2 x T=2, each stage's two members summing on their GPUs in one
# chain with the pipeline's transfers, against the two stages as threads of one process.
"${mpirun[@]}" -np 4 "$gpipe" train "$config" "${common[@]}" --set 'pipeline.devices=[cuda,cuda]' \
  --set pipeline.tensor_parallel=2 --set output.dir="$tmp/tp2" > "$tmp/tp2.log" 2>&1 ||
  { cat "$tmp/tp2.log"; echo "FAIL: mpirun -np 4 with K=2 x T=2 over NCCL"; exit 1; }
same_losses threads tp2 12 "between one process and K=2 x T=2 over NCCL"
echo "ok: K=2 x T=2 over NCCL gives the single-process losses"
