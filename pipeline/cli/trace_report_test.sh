#!/usr/bin/env bash
# trace.json and report.html of real runs, checked as Perfetto and a browser need them
# (pipeline/report/trace_check.py, pipeline/report/report_check.py): one process at K=2 (GPipe) and
# K=3 (zero bubble, one slice per instruction including W), interleaved 1F1B (two cells
# per stage), two processes under mpirun (1F1B, clocks aligned by ping-pongs), K=2 x D=2
# on four processes (the replicas' all-reduce slices), and
# output.trace: false (no trace, still a page); MFU against a hand count of the FLOPs.
# Instruction counts per stage and step
# are the programs' lengths, counted by hand from each schedule (M=4, except_last).
set -uo pipefail
gpipe="$1" trace_check="$2" report_check="$3"
tmp="${TEST_TMPDIR:-/tmp}/trace_report_test"
rm -rf "$tmp" && mkdir -p "$tmp"
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
export GPIPE_PEAK_CACHE="$tmp/peaks.json"  # the device peaks' cache (MFU), the test's own

cat > "$tmp/mlp.yaml" <<YAML
model:
  input: [32]
  layers:
    - {type: linear, out: 64}
    - repeat: 4
      layers:
        - {type: relu}
        - {type: linear, out: 64}
    - {type: linear, out: 10}
  loss: {type: softmax_cross_entropy}
data: {type: teacher, classes: 10, eval_samples: 64}
pipeline: {partitions: 2, micro_batches: 4, recompute: except_last}
optimizer: {type: sgd, lr: 0.05, momentum: 0.9}
train: {steps: 7, batch_size: 32, log_interval: 10}
trace: {steps: [2, 5]}
YAML

run() {  # name, processes, then --set overrides
  local name="$1" np="$2"
  shift 2
  local cmd=("$gpipe" train "$tmp/mlp.yaml" --set output.dir="$tmp/$name" "$@")
  if [ "$np" -gt 1 ]; then cmd=("${mpirun[@]}" -np "$np" "${cmd[@]}"); fi
  "${cmd[@]}" > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; echo "FAIL: $name did not run"; exit 1; }
}
check() {  # name, stages, instructions per stage
  python3 "$trace_check" "$tmp/$1/trace.json" 2,5 "$3" || { echo "FAIL: $1's trace"; exit 1; }
  python3 "$report_check" "$tmp/$1/report.html" "$2" 2,5 || { echo "FAIL: $1's page"; exit 1; }
}

run gpipe_k2 1 --set train.log_interval=2 --set train.eval_interval=3
check gpipe_k2 2 20,20
# One step numbering everywhere, the terminal's (from 1): each progress line's step and
# loss is report.json's step of that number, the trace's step slices carry the numbers
# of trace.steps with report.json's losses, and the validations sit at the steps the
# terminal printed them with (3, 6, and the last, 7).
python3 - "$tmp/gpipe_k2.log" "$tmp/gpipe_k2/report.json" "$tmp/gpipe_k2/trace.json" <<'PY' ||
import json, re, sys
log, report, trace = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
printed = [(int(m[1]), float(m[2]), m[3]) for m in re.finditer(r"step +(\d+)/7  loss (\S+)(  val_loss \S+)?", log)]
assert [p[0] for p in printed] == [1, 2, 3, 4, 6, 7], printed
steps = {s["step"]: s["loss"] for s in report["steps"]}
assert sorted(steps) == list(range(1, 8)), sorted(steps)
for n, loss, _ in printed:
    assert abs(steps[n] - loss) <= 5e-5 * max(1, abs(loss)), (n, loss, steps[n])
assert [v["step"] for v in report["validation"]] == [3, 6, 7], report["validation"]
# Each validation on the line of its step, the last step's too, as report.json has it.
assert [p[0] for p in printed if p[2]] == [3, 6, 7], printed
vals = {v["step"]: v["loss"] for v in report["validation"]}
assert all(abs(float(p[2].split()[1]) - vals[p[0]]) <= 5e-5 for p in printed if p[2]), (printed, vals)
assert report["trace"]["steps"] == [2, 5], report["trace"]
traced = {e["args"]["step"]: e["args"]["loss"] for e in trace["traceEvents"] if e.get("cat") == "step"}
assert sorted(traced) == [2, 3, 4, 5], sorted(traced)
assert all(traced[n] == steps[n] for n in traced), (traced, steps)
assert [l["first_step"] for l in report["launches"]] == [1], report["launches"]
PY
  { echo "FAIL: the terminal, report.json and the trace number steps differently"; exit 1; }
# MFU: the useful FLOPs per stage are the forward and backward of its layers, counted here
# by hand from the layers' formulas (a linear layer: forward 2bio + bo, dW 2bio + io + bo,
# dx 2bio except the first layer's; a ReLU 1 per element each way; the softmax
# cross-entropy 5 per logit forward and 2 back; recompute left out),
# over the stages' peaks in the cache file, per second of report.json's step; the terminal
# and the page show the same percentages.
python3 - "$tmp/gpipe_k2.log" "$tmp/gpipe_k2/report.json" "$tmp/gpipe_k2/report.html" "$GPIPE_PEAK_CACHE" <<'PY' ||
import json, re, sys
log, report, page = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), open(sys.argv[3]).read()
cache = json.load(open(sys.argv[4]))["peaks"]
layers = [(32, 64)] + [64, (64, 64)] * 4 + [(64, 10)]
def flops(layer, b, first, last):
    if isinstance(layer, int):
        return 2 * b * layer
    i, o = layer
    loss = 7 * b * o if last else 0
    return (2 * b * i * o + b * o) + (2 * b * i * o + i * o + b * o) + (0 if first else 2 * b * i * o) + loss
micro = [8] * 4
want, first = [], 0
for n in report["balance"]:
    want.append(sum(flops(layers[j], b, j == 0, j == 9) for j in range(first, first + n) for b in micro))
    first += n
assert [s["useful_flops"] for s in report["stages"]] == want, (want, report["stages"])
assert report["useful_flops"] == sum(want)
peaks = [s["peak_flops_per_second"] for s in report["stages"]]
assert len(cache) == 1 and all(p == list(cache.values())[0] for p in peaks), (cache, peaks)
assert abs(report["peak_flops_per_second"] - sum(peaks)) <= 1e-9 * sum(peaks)
seconds = report["step_ms"] / 1e3
mfu = sum(want) / seconds / sum(peaks)
assert abs(report["mfu"] - mfu) <= 1e-9, (report["mfu"], mfu)
stage_mfu = [w / seconds / p for w, p in zip(want, peaks)]
for s, m in zip(report["stages"], stage_mfu):
    assert abs(s["mfu"] - m) <= 1e-9, (s["mfu"], m)
printed = re.search(r"^MFU: (\S+)%", log, re.M)
assert printed and printed[1] == "%.1f" % (100 * mfu), (printed, mfu)
rows = re.findall(r"^(\d) .* (\S+)% +(\S+)% +\S+ MiB$", log, re.M)
assert [r[2] for r in rows] == ["%.1f" % (100 * m) for m in stage_mfu], (rows, stage_mfu)
assert ">%.1f%%<" % (100 * mfu) in page, "the page's MFU card"
for k, m in enumerate(stage_mfu):
    assert "stage %d %.1f%% of" % (k, 100 * m) in page, ("the page's stage MFU", k)
PY
  { echo "FAIL: MFU in the terminal, report.json or the page is not the FLOPs counted by hand over the peaks"; exit 1; }
run zb_k3 1 --set pipeline.partitions=3 --set pipeline.schedule=zero_bubble
check zb_k3 3 25,33,21
# Weight gradients batched: one W over the drain's four micro-batches per stage and step,
# named for them in the trace and on the page.
run batched_w 1 --set pipeline.batch_weight_gradients=true
check batched_w 2 21,21
python3 - "$tmp/batched_w/trace.json" "$tmp/batched_w/report.html" <<'PY' ||
import json, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("cat") == "weight_gradient"]
assert sorted((e["pid"], e["args"]["step"]) for e in ev) == [(k, s) for k in (0, 1) for s in range(2, 6)], ev
assert all(e["name"] == "W0-3" and e["args"]["micro_batch"] == 0 and e["args"]["micro_batches"] == 4 for e in ev), ev
assert "<title>W0-3 (weight_gradient)" in open(sys.argv[2]).read()
PY
  { echo "FAIL: batched_w's trace or page does not show one W over micro-batches 0-3"; exit 1; }
run interleaved 1 --set pipeline.schedule=interleaved_1f1b --set pipeline.virtual_stages=2
check interleaved 2 49,45
run mpi_1f1b 2 --set pipeline.schedule=1f1b
check mpi_1f1b 2 21,17
# Both processes' peaks reach the report (gathered to the first stage).
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["mfu"] > 0 and all(s["peak_flops_per_second"] > 0 for s in r["stages"]), r["stages"]' \
  "$tmp/mpi_1f1b/report.json" || { echo "FAIL: the two-process run's report has no peak for every stage"; exit 1; }
# Two replicas of a 2-stage pipeline on four processes: every stage's gradient
# all-reduce is an instruction of its own (RG, one more per stage), a slice of the
# communication track before its optimizer step.
run mpi_dp 4 --set pipeline.replicas=2
python3 "$trace_check" "$tmp/mpi_dp/trace.json" 2,5 21,21 --all-reduce || { echo "FAIL: mpi_dp's trace"; exit 1; }
python3 "$report_check" "$tmp/mpi_dp/report.html" 2 2,5 || { echo "FAIL: mpi_dp's page"; exit 1; }
# The backend ops each stage called: the trace's per instruction (step 5) add up to
# report.json's per step in F, R, B and W, which is the plan's count on shapes, and stay
# below its count in all (which has the calls outside the instructions too); in one
# process and gathered from two (the trace's wire format).
for name in gpipe_k2 mpi_1f1b; do
  python3 - "$tmp/$name/trace.json" "$tmp/$name/report.json" <<'PY' ||
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
report = json.load(open(sys.argv[2]))
compute = {"forward", "recompute", "backward", "weight_gradient"}
for k, st in enumerate(report["stages"]):
    mine = [e for e in events if e.get("ph") == "X" and e.get("pid") == k and e.get("args", {}).get("step") == 5
            and e.get("cat") != "step"]
    assert mine, k
    all_ops = sum(e["args"].get("ops", 0) for e in mine)
    compute_ops = sum(e["args"].get("ops", 0) for e in mine if e["cat"] in compute)
    assert compute_ops == st["ops_per_step"] > 0, (k, compute_ops, st)
    assert compute_ops < all_ops < st["ops_per_step_all"], (k, all_ops, st)  # and the calls outside them
    assert st["ops_per_step"] == report["prediction"]["stages"][k]["ops_per_step"], (k, st, report["prediction"])
PY
    { echo "FAIL: $name's ops per instruction, per step and planned disagree"; exit 1; }
done
grep -q '"rank 1' "$tmp/mpi_1f1b/trace.json" || grep -q 'rank 1 ' "$tmp/mpi_1f1b/trace.json" ||
  { echo "FAIL: the merged trace does not name rank 1"; exit 1; }

# Clipping: every stage's gradient-norm all-reduce (NORM) is an instruction of its own.
run clip_k2 1 --set optimizer.clip_grad_norm=1.0
check clip_k2 2 21,21
python3 - "$tmp/clip_k2/trace.json" <<'PY' || { echo "FAIL: clip_k2's trace has no NORM slice per stage and step"; exit 1; }
import json, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("cat") == "gradient_norm"]
assert sorted((e["pid"], e["args"]["step"]) for e in ev) == [(k, s) for k in (0, 1) for s in range(2, 6)], ev
PY

run no_trace 1 --set output.trace=false
[ ! -e "$tmp/no_trace/trace.json" ] || { echo "FAIL: output.trace=false wrote trace.json"; exit 1; }
[ -s "$tmp/no_trace/report.html" ] || { echo "FAIL: no report.html without a trace"; exit 1; }
ls "$tmp"/*/ | grep -q '\.tmp' && { echo "FAIL: a temporary file was left behind"; exit 1; }
echo "all traces and pages check out"
