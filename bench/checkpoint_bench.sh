#!/usr/bin/env bash
# Checkpoint figures for bench/RESULTS.md: save and load throughput against a plain copy (dd, fsync) of the
# same bytes, the training stall of a synchronous and an asynchronous save (GPT config
# and a 1.6 GB model), and the time from a killed job to training again under
# `gpipe run`.
#
#   bench/checkpoint_bench.sh [DIR]     (DIR: scratch space on the disk to measure; default /tmp)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
dir="${1:-/tmp}/gpipe-ckpt-bench"
bazel build -c opt //bench:checkpoint_bench //pipeline:gpipe >&2
bin="$(bazel info -c opt bazel-bin 2>/dev/null)"
mkdir -p "$dir"
for cfg in configs/gpt.yaml bench/configs/big_mlp.yaml; do
  "$bin/bench/checkpoint_bench" "$cfg" "$dir/scratch" --repeats 3 2>/dev/null | grep "^{"
done > "$dir/lines.jsonl"
python3 - "$dir/lines.jsonl" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows.setdefault((r["config"], r["what"]), []).append(r)
print("| config | checkpoint | save (sync) | stall (async) | stall / save | load | dd copy + fsync |")
print("|---|---|---|---|---|---|---|")
for cfg in sorted({k[0] for k in rows}):
    med = {w: statistics.median(x["seconds"] for x in rows[(cfg, w)]) for w in ("sync", "stall", "load", "copy")}
    b = rows[(cfg, "sync")][0]["bytes"]
    gb = lambda s: f"{s * 1e3:.0f} ms ({b / s / 1e9:.2f} GB/s)"
    print(f"| {cfg} | {b / 1e6:.0f} MB | {gb(med['sync'])} | {med['stall'] * 1e3:.1f} ms | "
          f"{med['stall'] / med['sync']:.0%} | {gb(med['load'])} | {gb(med['copy'])} |")
# Each save beside the copy made right after it: the disk's rate drifts between them.
print()
print("| config | repeat | save s | dd copy s | save / copy |")
print("|---|---|---|---|---|")
for cfg in sorted({k[0] for k in rows}):
    for i, (a, c) in enumerate(zip(rows[(cfg, "sync")], rows[(cfg, "copy")])):
        print(f"| {cfg} | {i + 1} | {a['seconds']:.3f} | {c['seconds']:.3f} | {a['seconds'] / c['seconds']:.2f} |")
PY

# Restart under the supervisor: kill -9 the job after its checkpoint at step 20, time
# until the restarted job logs its first step.
rm -rf "$dir/run"; mkdir -p "$dir/run"
"$bin/pipeline/gpipe" run --max-restarts 1 configs/default.yaml --set train.steps=60 --set train.log_interval=1 \
  --set checkpoint.every=20 --set output.dir="$dir/run" > "$dir/run.log" 2>&1 &
sup=$!
until [ -e "$dir/run/checkpoints/step-20/COMPLETE" ]; do sleep 0.05; done
child="$(pgrep -f "gpipe train configs/default.yaml --set train.steps=60" | head -1)"
t0=$(date +%s.%N)
kill -9 "$child"
# The restarted job logs "resumed from ..." and then its first step line.
until awk '/resumed from/ {seen = 1} seen && /^step / {found = 1} END {exit !found}' "$dir/run.log"; do sleep 0.02; done
t1=$(date +%s.%N)
wait "$sup" || true
echo "restart: kill -9 to the restarted job's first step: $(python3 -c "print(f'{$t1 - $t0:.2f} s')")"
rm -rf "$dir"
