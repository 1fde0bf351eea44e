#!/usr/bin/env bash
# `auto` for pipeline.partitions, pipeline.micro_batches, pipeline.schedule and
# train.blas_threads, through the built program: a run with no profile measures one
# first; the sweep ranks the plans that fit and keep the config's recompute mode on that
# profile, times its best three and the plain pipeline (K = the cores, M = 8, GPipe) for
# real steps, and the run trains the measured fastest (and says so); `gpipe plan --sweep`
# shows the same columns, predicted and measured, and recommends its measured fastest;
# a key the config names is kept; the refusals (under mpirun, a balance beside partitions: auto) exit 2
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
python3 - auto.log sweep.log run/report.json <<'PY' || { cat auto.log sweep.log; echo "FAIL: auto did not take the measured choice"; exit 1; }
import json, re, sys
auto, sweep, report = open(sys.argv[1]).read(), open(sys.argv[2]).read(), json.load(open(sys.argv[3]))
# (a sweep tries tensor-parallel plans too, and times them: " T=2")
label_re = r"K=\d+(?: v=\d+)? M=\d+ \S+ recompute=\S+(?: blas_threads=\d+)?(?: T=\d+(?: seq)?)?"
def timed(log):
    """The plans a log timed: (label, predicted ms, measured ms, the config's own?), as printed."""
    return [(m[1], float(m[2]), float(m[3]), bool(m[4])) for m in re.finditer(
        r"^  (%s) +predicted +([0-9.]+) ms, measured +([0-9.]+) ms(  \(the config's own\))?$" % label_re, log, re.M)]
def chosen_right(label, plans, eps=0.001):
    """Is `label` the measured fastest, or the config's own where nothing beats it by 3%?
    Within the printed figures' rounding (3 decimals): either side of a tie passes."""
    by = {p[0]: p for p in plans}
    assert label in by, (label, plans)
    best = min(p[2] for p in plans)
    own = [p for p in plans if p[3]][0]
    if by[label][3]:
        return best >= 0.97 * own[2] - 2 * eps
    return by[label][2] <= best + 2 * eps and by[label][2] <= 0.97 * own[2] + 2 * eps
# auto: the planner's best 3 shapes (recompute except_last, as the config keeps) and the plain
# pipeline (K = the cores, M = 8, GPipe, one BLAS thread) timed; the choice is the measured one.
plans = timed(auto)
assert len(plans) == 4, auto
assert all("recompute=except_last" in p[0] for p in plans), plans
assert [p for p in plans if p[3]][0][0].startswith("K=2 M=8 gpipe "), plans
line = re.search(r"^auto: (.*): of \d+ plans that fit and keep the config's other keys, the fastest timed here, (.+?), "
                 r"measured ([0-9.]+) ms a step", auto, re.M)
assert line, auto
chosen = line[2]
assert chosen_right(chosen, plans), (chosen, plans)
k = int(re.search(r"K=(\d+)", chosen)[1]); m = int(re.search(r"M=(\d+)", chosen)[1])
schedule = re.search(r"M=\d+ (\S+)", chosen)[1]
threads = int((re.search(r"blas_threads=(\d+)", chosen) or [0, 1])[1])
assert report["num_stages"] == k and report["micro_batches"] == m and report["schedule"] == schedule, report
for key, value in [("pipeline.partitions", k), ("pipeline.micro_batches", m), ("train.blas_threads", threads)]:
    assert "%s=%d" % (key, value) in line[1], (key, value, line[1])
assert "pipeline.schedule=" + schedule in line[1], line[1]
# gpipe plan --sweep: the table's measured column is what it timed, and it recommends the
# measured choice.
plans = timed(sweep)
assert len(plans) == 4, sweep
for label, predicted, measured, own in plans:
    row = re.search(r"^ *\d+  %s +([0-9.]+) +([0-9.]+) .*$" % re.escape(label), sweep, re.M)
    assert row and abs(float(row[1]) - predicted) <= 0.0051 and float(row[2]) == measured, (label, row and row[0])
rec = re.search(r"^Recommended: (.+)$", sweep, re.M)[1]
assert chosen_right(rec, plans), (rec, plans)
# The timings are kept in the profile, one calibration per (stages, BLAS threads) timed, and
# the next sweep scales its predictions by them.
calibrations = json.load(open("profile.json"))["calibrations"]
timed_keys = {(int(re.search(r"K=(\d+)", p[0])[1]), int((re.search(r"blas_threads=(\d+)", p[0]) or [0, 1])[1]))
              for p in timed(auto) + plans}
assert calibrations and all((c["stages"], c["blas_threads"]) in timed_keys and c["ratio"] > 0 for c in calibrations), \
    (calibrations, timed_keys)
assert "The timings correct the planner from now on" in auto, auto
assert "step times scaled by" in sweep, sweep
PY
# Plans for more devices than this machine has are not timed, and say so; --time-best 0 times nothing.
many=$(( $(nproc) + 2 ))
"$gpipe" plan small.yaml --sweep --devices "$many" > many.log 2>&1 || { cat many.log; echo "FAIL: --devices $many"; exit 1; }
grep -qF "Not timed (the recommendation is the prediction's): it plans for $many CPU devices and this machine has $(nproc) cores" many.log &&
  ! grep -q "^Timing " many.log || { cat many.log; echo "FAIL: a sweep for devices this machine lacks was timed"; exit 1; }
"$gpipe" plan small.yaml --sweep --time-best 0 > none.log 2>&1 || { cat none.log; echo "FAIL: --time-best 0"; exit 1; }
! grep -q "^Timing \|measured ms" none.log || { cat none.log; echo "FAIL: --time-best 0 timed plans"; exit 1; }
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
