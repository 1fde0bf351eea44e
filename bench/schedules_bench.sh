#!/usr/bin/env bash
# Every schedule at K = 2 on the two cores: step time, measured bubble, the schedule's
# formula, the simulator's prediction (the schedule simulated with the run's own mean
# per-instruction times), and peak activation memory per stage, for the MLP of the
# benchmarks and configs/gpt.yaml at M = 4, 8, 16, without rematerialization (so the
# memory column shows what each schedule keeps alive). Figures for bench/RESULTS.md.
#
#   bench/schedules_bench.sh [--quick]
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
quick=0; [ "${1:-}" = "--quick" ] && quick=1
bazel build -c opt //pipeline:gpipe >&2
gpipe="$(bazel info -c opt bazel-bin 2>/dev/null)/pipeline/gpipe"
out="$(mktemp -d /tmp/gpipe-sched.XXXXXX)"
run() {  # config steps batch M schedule virtual_stages
  local cfg="$1" steps="$2" batch="$3" m="$4" sched="$5" v="$6"
  local name; name="$(basename "$cfg" .yaml)-m$m-$sched-v$v"
  "$gpipe" train "$cfg" --set train.steps="$steps" --set train.batch_size="$batch" --set train.log_interval=1000 \
    --set train.eval_interval=0 --set data.eval_samples=16 --set pipeline.micro_batches="$m" \
    --set pipeline.schedule="$sched" --set pipeline.virtual_stages="$v" --set pipeline.recompute=never \
    --set output.dir="$out/$name" > "$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
  echo "$cfg $m $sched $v $out/$name/report.json"
}
runs="$out/runs.txt"
for m in 4 8 16; do
  for s in "gpipe 1" "1f1b 1" "zero_bubble 1" "interleaved_1f1b 2"; do
    run configs/mlp.yaml $((quick ? 10 : 60)) 128 $m $s
    run configs/gpt.yaml $((quick ? 3 : 8)) 16 $m $s
  done
done > "$runs"
python3 - "$runs" <<'PY'
import json, sys
print("| config | M | schedule | step ms | bubble measured | predicted | formula | peak activations stage 0 / 1 (MB) |")
print("|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    cfg, m, sched, v, path = line.split()
    r = json.load(open(path))
    b = r["bubble"]
    name = sched + (f" (v={v})" if v != "1" else "")
    peaks = " / ".join(f"{s['peak_activation_bytes'] / 1e6:.1f}" for s in r["stages"])
    print(f"| {cfg} | {m} | {name} | {r['step_ms']:.1f} | {b['measured']:.3f} | {b['predicted']:.3f} | "
          f"{b['formula']:.3f} | {peaks} |")
PY
rm -rf "$out"
