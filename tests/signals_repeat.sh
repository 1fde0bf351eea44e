#!/usr/bin/env bash
# Ctrl-C and SIGTERM to a two-process job, many times in a row (issue 18): each time,
# `gpipe run --np 2` must exit 128 + signal, both ranks must have stopped after the same
# step, and that step's checkpoint must be COMPLETE and load (a resume of one step). The
# signal comes at a random moment of the run, alternating SIGINT and SIGTERM. Not part of
# ./gpipe test (the suite runs the same check three times in run_integrity_test); the
# figures of a run go into TESTING.md.
#
#   tests/signals_repeat.sh [N]      N tries (default 10); exit 0 when every try passed
set -uo pipefail
n="${1:-10}"
root="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
cuda="${CUDA_PATH:-/usr/local/cuda}"  # the build ./gpipe makes (with CUDA where nvcc exists)
flags=(); [ -x "$cuda/bin/nvcc" ] && [ "${GPIPE_NO_CUDA:-0}" != "1" ] && flags=(--config=cuda)
cd "$root" && bazel build "${flags[@]}" //pipeline:gpipe >&2 || exit 2
gpipe="$root/bazel-bin/pipeline/gpipe"
work="$(mktemp -d /tmp/gpipe-signals.XXXXXX)"
cd "$work" || exit 2
cat > mlp.yaml <<YAML
model:
  input: [64]
  layers:
    - {type: linear, out: 256}
    - {type: relu}
    - {type: linear, out: 256}
    - {type: relu}
    - {type: linear, out: 10}
  loss: {type: softmax_cross_entropy}
data: {classes: 10, eval_samples: 64}
pipeline: {partitions: 2, micro_batches: 4}
optimizer: {type: adam, lr: 0.001}
train: {steps: 100000, batch_size: 64, log_interval: 1}
YAML
passed=0
for i in $(seq "$n"); do
  sig=$([ $((i % 2)) -eq 1 ] && echo INT || echo TERM)
  want=$([ "$sig" = INT ] && echo 130 || echo 143)
  d="try$i"
  timeout 300 "$gpipe" run --np 2 mlp.yaml --set output.dir="$d" > "$d.log" 2>&1 &
  job=$!
  for _ in $(seq 600); do grep -q '^step ' "$d.log" && break; sleep 0.1; done
  sleep "0.$((RANDOM % 10))"
  kill -"$sig" $job; wait $job
  rc=$?
  s0="$(grep -oE 'rank 0: stopped .* after step [0-9]+' "$d.log" | grep -oE '[0-9]+$')"
  s1="$(grep -oE 'rank 1: stopped .* after step [0-9]+' "$d.log" | grep -oE '[0-9]+$')"
  verdict="ok"
  if [ "$rc" -ne "$want" ]; then verdict="exit $rc, want $want"
  elif [ -z "$s0" ] || [ "$s0" != "$s1" ]; then verdict="ranks stopped after steps '$s0' and '$s1'"
  elif [ ! -e "$d/checkpoints/step-$s0/COMPLETE" ]; then verdict="step-$s0 is not complete"
  elif ! "$gpipe" train mlp.yaml --set output.dir="$d" --set train.steps=$((s0 + 1)) --resume > "$d-resume.log" 2>&1 ||
       ! grep -q "resumed from $d/checkpoints/step-$s0 at step $s0" "$d-resume.log"; then verdict="step-$s0 does not resume"
  fi
  [ "$verdict" = ok ] && passed=$((passed + 1))
  echo "try $i: SIG$sig after step ${s0:-?}: $verdict"
done
echo "$passed of $n tries saved every rank's shard of one step and resumed ($work)"
[ "$passed" -eq "$n" ]
