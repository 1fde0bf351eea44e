#!/usr/bin/env bash
# `auto` for pipeline.partitions, pipeline.micro_batches, pipeline.schedule and
# train.blas_threads, through the built program: a run with no profile measures one
# first, then trains the plan `gpipe plan --sweep` ranks fastest among those that fit and
# keep the config's recompute mode, on that same profile (and says so); a key the config
# names is kept; the refusals (under mpirun, a balance beside partitions: auto) exit 2
# with the fix.
set -uo pipefail
gpipe="$(readlink -f "$1")"
tmp="${TEST_TMPDIR:-/tmp}/auto_plan"
rm -rf "$tmp" && mkdir -p "$tmp"
cd "$tmp" || exit 1
export GPIPE_PEAK_CACHE="$tmp/peaks.json"

cat > small.yaml <<EOF
model:
  input: [16]
  layers:
    - {type: linear, out: 32}
    - {type: relu}
    - {type: linear, out: 32}
    - {type: relu}
    - {type: linear, out: 4}
  loss: {type: softmax_cross_entropy}
data: {classes: 4, eval_samples: 16}
pipeline: {partitions: auto, micro_batches: auto, schedule: auto, recompute: except_last, profile: $tmp/profile.json}
train: {steps: 3, batch_size: 8, blas_threads: auto}
output: {dir: $tmp/run}
EOF

"$gpipe" train small.yaml > auto.log 2>&1 || { cat auto.log; echo "FAIL: the auto run did not train"; exit 1; }
grep -q "auto: no profile of this model in $tmp/profile.json; measuring a short one first" auto.log ||
  { cat auto.log; echo "FAIL: the auto run did not say it measured a profile first"; exit 1; }
[ -s profile.json ] || { echo "FAIL: no profile written"; exit 1; }
"$gpipe" plan small.yaml --sweep --rows 200 > sweep.log 2>&1 || { cat sweep.log; echo "FAIL: the sweep"; exit 1; }
python3 - auto.log sweep.log run/report.json <<'PY' || { cat auto.log sweep.log; echo "FAIL: auto did not take the sweep's choice"; exit 1; }
import json, re, sys
auto, sweep, report = open(sys.argv[1]).read(), open(sys.argv[2]).read(), json.load(open(sys.argv[3]))
# The sweep's rows: rank, the label, ... ; the first that fits with recompute=except_last.
rows = re.findall(r"^ *\d+  (K=\d+(?: v=\d+)? M=\d+ \S+ recompute=(\S+)(?: blas_threads=\d+)?) .*$", sweep, re.M)
assert rows, sweep
fits = [label for label, rc in rows if rc == "except_last"]
line = re.search(r"^auto: (.*): the fastest of \d+ plans that fit and keep the config's other keys, (.+?), predicted", auto, re.M)
assert line, auto
assert line[2] == fits[0], (line[2], fits[0])
k = int(re.search(r"K=(\d+)", fits[0])[1]); m = int(re.search(r"M=(\d+)", fits[0])[1])
schedule = re.search(r"M=\d+ (\S+)", fits[0])[1]
threads = int((re.search(r"blas_threads=(\d+)", fits[0]) or [0, 1])[1])
assert report["num_stages"] == k and report["micro_batches"] == m and report["schedule"] == schedule, report
for key, value in [("pipeline.partitions", k), ("pipeline.micro_batches", m), ("train.blas_threads", threads)]:
    assert "%s=%d" % (key, value) in line[1], (key, value, line[1])
assert "pipeline.schedule=" + schedule in line[1], line[1]
PY
# The profile is reused; a key the config names is kept (K=2 here).
"$gpipe" train small.yaml --set pipeline.partitions=2 --set output.dir="$tmp/run2" > fixed.log 2>&1 ||
  { cat fixed.log; echo "FAIL: the run with partitions 2 did not train"; exit 1; }
grep -q "measuring a short one first" fixed.log && { echo "FAIL: the profile was measured again"; exit 1; }
grep -q "^Pipeline: K=2 stages" fixed.log || { cat fixed.log; echo "FAIL: pipeline.partitions=2 not kept"; exit 1; }
grep -q "^auto: pipeline.micro_batches=" fixed.log || { cat fixed.log; echo "FAIL: no auto line without partitions"; exit 1; }

# Refusals: exit 2, the reason and the fix.
expect() {  # message, then the command
  local message="$1"; shift
  "$@" > refuse.log 2>&1
  local rc=$?
  [ "$rc" -eq 2 ] && grep -qF "$message" refuse.log || { cat refuse.log; echo "FAIL: rc $rc, wanted 2 and '$message'"; exit 1; }
}
expect "pipeline.balance fixes the number of stages but pipeline.partitions is auto: remove pipeline.balance" \
  "$gpipe" train small.yaml --set "pipeline.balance=[2,3]" --set output.dir="$tmp/run3"
expect "auto chooses in one process, and every process of this run would choose on its own; give the values" \
  timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$gpipe" train small.yaml --set output.dir="$tmp/run4"
echo "auto chose the sweep's plan"
