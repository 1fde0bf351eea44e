#!/usr/bin/env bash
# Every mistake on the command line, through the built program: it exits 2 (a user's
# mistake), prints `gpipe: error: ...` naming the argument or key and the fix, and
# trains nothing. Then the mistakes only a multi-process launch can make, under mpirun.
set -uo pipefail
gpipe="$(readlink -f "$1")"  # the script works in its own directory
tmp="${TEST_TMPDIR:-/tmp}/cli_errors"
mkdir -p "$tmp"
cd "$tmp" || exit 1
mpirun=(timeout 120 mpirun --allow-run-as-root --oversubscribe)

cat > small.yaml <<EOF
model:
  input: [8]
  layers:
    - {type: linear, out: 16}
    - {type: relu}
    - {type: linear, out: 4}
  loss: {type: softmax_cross_entropy}
data: {classes: 4, eval_samples: 16}
pipeline: {partitions: 2, micro_batches: 2}
train: {steps: 2, batch_size: 8}
output: {dir: $tmp/run}
EOF

n=0
# expect RC MESSAGE -- COMMAND...: exit status RC and MESSAGE (fixed string) in the output.
expect() {
  local want_rc="$1" message="$2"; shift 3
  "$@" > out.log 2>&1
  local rc=$?
  n=$((n + 1))
  if [ "$rc" -ne "$want_rc" ] || ! grep -qF -- "$message" out.log; then
    cat out.log; echo "FAIL: '$*' gave rc=$rc (want $want_rc) without: $message"; exit 1
  fi
}

expect 2 "gpipe: error: no command given" -- "$gpipe"
grep -q "usage:" out.log || { cat out.log; echo "FAIL: no usage after 'no command given'"; exit 1; }
expect 2 "gpipe: error: unknown command 'trian'" -- "$gpipe" trian small.yaml
expect 2 "gpipe: error: --set needs KEY=VALUE, e.g. --set train.steps=10" -- "$gpipe" train small.yaml --set
expect 2 "gpipe: error: unknown option '--steps'" -- "$gpipe" train small.yaml --steps 3
expect 2 "gpipe: error: unexpected argument 'other.yaml' for plan (one config file at most)" -- "$gpipe" plan small.yaml other.yaml
expect 2 "gpipe: error: cannot read config file 'no/such.yaml'; check the path" -- "$gpipe" plan no/such.yaml
expect 2 "gpipe: error: config error at --set train.steps=many: train.steps: expected an integer, got 'many'" -- \
  "$gpipe" train small.yaml --set=train.steps=many
expect 2 "gpipe: error: config error at --set pipeline.checkpoint=later: pipeline.checkpoint: unknown mode 'later'" -- \
  "$gpipe" plan small.yaml --set pipeline.checkpoint=later
expect 2 "gpipe: error: --set pipeline: expected KEY=VALUE" -- "$gpipe" plan small.yaml --set pipeline
expect 2 "raise train.batch_size to at least 16 or lower pipeline.micro_batches" -- \
  "$gpipe" train small.yaml --set pipeline.micro_batches=16
expect 2 "pipeline.replicas = 2 needs 2 copies of the pipeline: launch mpirun -np 4" -- \
  "$gpipe" train small.yaml --set pipeline.replicas=2
# A directory as data.path: std::ifstream opens it and fails only when read.
expect 2 "gpipe: error: data.path '$tmp' is a directory, not a file; set data.path to the text file itself" -- \
  "$gpipe" train small.yaml --set data.type=text --set "data.path=$tmp"
expect 2 "gpipe: error: text file '$tmp/no_such.txt' cannot be read (No such file or directory)" -- \
  "$gpipe" train small.yaml --set data.type=text --set "data.path=$tmp/no_such.txt"
expect 2 "gpipe: error: config error at --set optimizer.warmup_steps=-5: optimizer.warmup_steps: must be at least 0" -- \
  "$gpipe" train small.yaml --set optimizer.warmup_steps=-5
# Weights that cannot fit (200000 x 200000 float64: 320 GB) are refused before any is
# allocated, with the advice for weights, not for micro-batches.
expect 2 "do not depend on pipeline.micro_batches or train.batch_size" -- \
  "$gpipe" train small.yaml --set model.dtype=float64 --set model.layers.0.out=200000 --set model.input=[200000]
[ ! -e "$tmp/run/report.json" ] || { echo "FAIL: a refused run wrote a report"; exit 1; }
for h in help --help -h; do
  expect 0 "gpipe plan [CONFIG.yaml]" -- "$gpipe" "$h"
done
expect 0 "schedule gpipe, recompute except_last" -- "$gpipe" plan small.yaml --set=pipeline.micro_batches=4  # the --set= form works
# A built-in schedule written as a schedule file, in either notation, runs as itself.
expect 0 "wrote the schedule to zb.csv" -- "$gpipe" plan small.yaml --set pipeline.schedule=zero_bubble --schedule-file-out zb.csv
grep -qx "1,W,1" zb.csv || { cat zb.csv; echo "FAIL: zb.csv has no line 1,W,1"; exit 1; }
"$gpipe" plan small.yaml --set pipeline.schedule=zero_bubble | grep "^stage [01]: [rF]" > builtin.txt
for f in zb.csv zb.txt; do
  [ -e "$f" ] || expect 0 "wrote the schedule to $f" -- "$gpipe" plan small.yaml --set pipeline.schedule=zero_bubble --schedule-file-out "$f"
  expect 0 "schedule file, recompute except_last" -- "$gpipe" plan small.yaml --set pipeline.schedule_file="$f"
  grep "^stage [01]: [rF]" out.log | diff - builtin.txt || { echo "FAIL: $f does not run as zero_bubble"; exit 1; }
done
grep -qx "1I1" zb.txt || { cat zb.txt; echo "FAIL: zb.txt is not in PyTorch's notation"; exit 1; }
expect 2 "gpipe: error: --schedule-file-out writes the schedule of the config as it is" -- \
  "$gpipe" plan small.yaml --sweep --schedule-file-out x.csv
echo "ok: $n command lines, each refused (or served) with its message"

# Under mpirun: every rank reads the same mistake; the job ends with it.
expect_mpi() {
  local message="$1"; shift 2
  "${mpirun[@]}" "$@" > out.log 2>&1
  local rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -qF -- "$message" out.log || ! grep -q "gpipe: error on rank [0-9]" out.log; then
    cat out.log; echo "FAIL: 'mpirun $*' gave rc=$rc without: $message"; exit 1
  fi
}
expect_mpi "launched as 3 processes but pipeline.partitions x pipeline.replicas is 2 x 2; run one process per stage and replica: mpirun -np 4" -- \
  -np 3 "$gpipe" train small.yaml --set pipeline.replicas=2
expect_mpi "train.batch_size = 9 does not split evenly over 2 replicas; make it a multiple of pipeline.replicas" -- \
  -np 4 "$gpipe" train small.yaml --set pipeline.replicas=2 --set train.batch_size=9
expect_mpi "pipeline.devices mixes cpu and cuda devices" -- \
  -np 2 "$gpipe" train small.yaml --set "pipeline.devices=[cpu:0, cuda:0]"
# CUDA stages where there are none: without CUDA support, without a GPU, or past the
# last GPU (no machine here has 8), each names pipeline.devices and the fix.
"${mpirun[@]}" -np 2 "$gpipe" train small.yaml --set "pipeline.devices=[cuda:7, cuda:7]" > out.log 2>&1
rc=$?
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -q "pipeline.devices puts the stage" out.log ||
   ! grep -qE "built without CUDA|no CUDA device is visible|visible CUDA device\(s\)" out.log; then
  cat out.log; echo "FAIL: CUDA stages on a machine without them (rc=$rc)"; exit 1
fi
echo "ok: multi-process launch mistakes end the job with the rank's message"
