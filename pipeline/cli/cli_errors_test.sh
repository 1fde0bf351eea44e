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
expect 2 "gpipe: error: --set needs KEY=VALUE, e.g. --set train.steps=10" -- "$gpipe" train small.yaml --set
expect 2 "gpipe: error: unknown option '--steps' for train; it has no such flag (a config field is set with --set KEY=VALUE)." -- \
  "$gpipe" train small.yaml --steps 3
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
# Flags: each command takes its own, spelled out. A mistyped, shortened or inapplicable
# one is refused (exit 2) by name, with what was probably meant, before anything runs.
expect 2 "gpipe: error: unknown command 'trian'; did you mean train?" -- "$gpipe" trian small.yaml
expect 2 "gpipe: error: unknown option '--swee' for plan; did you mean --sweep? (\`gpipe help plan\` lists its flags)" -- \
  "$gpipe" plan small.yaml --swee
expect 2 "gpipe: error: unknown option '--sw' for plan; did you mean --sweep?" -- "$gpipe" plan small.yaml --sw
expect 2 "gpipe: error: unknown option '--swep' for plan; did you mean --sweep?" -- "$gpipe" plan small.yaml --swep
expect 2 "gpipe: error: unknown option '--device' for plan; did you mean --devices or --device-spec?" -- \
  "$gpipe" plan small.yaml --device 8
# interleaved_1f1b without virtual stages runs, and says that it is plain 1F1B.
expect 0 "interleaved_1f1b with pipeline.virtual_stages 1 (the default) is plain 1F1B" -- \
  "$gpipe" train small.yaml --set pipeline.schedule=interleaved_1f1b --set output.dir="$tmp/interleaved"
# More devices than the model has layers: the refusal says that --devices set the stages.
expect 2 "lower pipeline.partitions or pipeline.virtual_stages (here pipeline.partitions is --devices 4: give fewer devices" -- \
  "$gpipe" plan small.yaml --devices 4
expect 2 "gpipe: error: unknown option '--device' for plan; did you mean --devices" -- "$gpipe" plan --device 8
expect 2 "gpipe: error: --rows applies only with --sweep: add --sweep, or drop --rows" -- "$gpipe" plan small.yaml --rows 3
expect 2 "gpipe: error: --max-micro-batches applies only with --sweep" -- "$gpipe" plan small.yaml --max-micro-batches 64
expect 2 "gpipe: error: unknown option '--resume' for plan; --resume is an option of train and run, not of plan." -- \
  "$gpipe" plan small.yaml --resume
expect 2 "gpipe: error: unknown option '--np' for train; --np is an option of run, not of train." -- \
  "$gpipe" train small.yaml --np 2
expect 2 "gpipe: error: unknown option '--sweep' for train; --sweep is an option of plan and profile, not of train." -- \
  "$gpipe" train small.yaml --sweep=yes
expect 2 "gpipe: error: --devices needs a value: --devices N" -- "$gpipe" plan small.yaml --devices
expect 2 "gpipe: error: --rows takes a positive integer, got 'many'" -- "$gpipe" plan small.yaml --sweep --rows many
expect 2 "gpipe: error: --np 0: expected a whole number of at least 1" -- "$gpipe" run --np 0 small.yaml
expect 2 "gpipe: error: unknown option '--swee' for plan" -- "$gpipe" plan small.yaml --rows 3 --swee  # the typo first
# Help for one command: each flag explained, and for plan how the sweep gets its memory limit.
expect 0 "Usage: gpipe plan [OPTIONS] [CONFIG.yaml]" -- "$gpipe" help plan
cp out.log help_plan.log
for word in "--sweep" "--rows N" "--max-micro-batches N" "--precisions LIST" "--devices N" "--device-spec FILE" "--schedule-file-out FILE" \
    "--set KEY=VALUE" "--set pipeline.memory_limit=8GiB" "(with --sweep)"; do
  grep -qF -- "$word" help_plan.log || { cat help_plan.log; echo "FAIL: gpipe help plan does not explain $word"; exit 1; }
done
for h in --help -h; do
  expect 0 "Usage: gpipe plan [OPTIONS] [CONFIG.yaml]" -- "$gpipe" plan small.yaml "$h"
  diff help_plan.log out.log || { echo "FAIL: gpipe plan $h is not gpipe help plan"; exit 1; }
done
expect 0 "Usage: gpipe run [OPTIONS] [CONFIG.yaml]" -- "$gpipe" run --help
grep -qF -- "--max-restarts N" out.log && ! grep -qF -- "--run-id" out.log || { cat out.log; echo "FAIL: gpipe run --help"; exit 1; }
expect 0 "gpipe help COMMAND (or gpipe COMMAND --help) explains each flag of COMMAND" -- "$gpipe" help
expect 2 "gpipe: error: unknown command 'plam'; did you mean plan?" -- "$gpipe" help plam
# Bytes in binary units, the unit over each column; the sweep says where it ran out of range.
expect 0 "| memory per stage, MiB" -- "$gpipe" plan small.yaml
! grep -E "[0-9] MB|total MB" out.log || { echo "FAIL: gpipe plan prints MB (10^6)"; exit 1; }
# Precisions in the sweep: only when asked, each named once, each a model.dtype.
expect 2 "gpipe: error: --precisions applies only with --sweep" -- "$gpipe" plan small.yaml --precisions float32,bf16
expect 2 "gpipe: error: --precisions float32,bfloat16,bf16 names bfloat16 twice" -- \
  "$gpipe" plan small.yaml --sweep --precisions float32,bfloat16,bf16
expect 2 "gpipe: error: --precisions float32,int8: 'int8' does not make a config:" -- \
  "$gpipe" plan small.yaml --sweep --precisions float32,int8
grep -qF "use float32, float64, bf16 or fp16" out.log || { cat out.log; echo "FAIL: --precisions int8 names the values"; exit 1; }
expect 0 "Recommended: " -- "$gpipe" plan small.yaml --sweep --precisions float32,bf16 --rows 400
grep -qF "costs: float32: " out.log && grep -qF "       bf16: " out.log && grep -qE "^ +[0-9]+ +K=.* bf16 " out.log &&
  grep -qE "^ +[0-9]+ +K=.* float32 " out.log && grep -qE "^  --set .* --set model.dtype=(float32|bf16)$" out.log ||
  { cat out.log; echo "FAIL: the sweep over precisions shows each precision's candidates and costs"; exit 1; }
# One precision other than the config's: its commands say so, or they would run in the config's.
expect 0 "Recommended: " -- "$gpipe" plan small.yaml --sweep --precisions bf16
grep -qE "^  --set .* --set model.dtype=bf16$" out.log && ! grep -qE " float32 " out.log ||
  { cat out.log; echo "FAIL: a sweep in bf16 alone prints commands that set model.dtype=bf16"; exit 1; }
# The predicted choice's edge (--time-best 0: timings would pick among near-equal plans by noise).
expect 0 "At the edge of the search:" -- "$gpipe" plan small.yaml --sweep --max-micro-batches 1 --time-best 0
grep -qF "M=1 is the most micro-batches the sweep tried (train.batch_size 8 allows up to 8); more may be faster still: add --max-micro-batches 2" out.log &&
  grep -qF "peak MiB" out.log && grep -qF "none per device; give one with --set pipeline.memory_limit=8GiB" out.log ||
  { cat out.log; echo "FAIL: the sweep's edge, unit or memory limit"; exit 1; }
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
