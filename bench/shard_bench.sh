#!/usr/bin/env bash
# Sharded optimizer state (pipeline.shard_optimizer, ZeRO-1), measured: the optimizer
# state each device keeps at K=1 x D=1, 2, 4 (the executor's own count, logged by every
# rank, beside the plan's in report.json), and the step time at K=2 x D=2 with and without
# sharding, alternated (none, optimizer, none, ...) so that both see the same machine.
#
#   bench/shard_bench.sh [GPIPE] [REPEATS]     (default bazel-bin/pipeline/gpipe, 3)
set -euo pipefail
gpipe="$(realpath "${1:-bazel-bin/pipeline/gpipe}")"
repeats="${2:-3}"
config="$(realpath configs/mlp.yaml)"
tmp="$(mktemp -d /tmp/gpipe-shard-bench.XXXXXX)"
mpirun=(mpirun --allow-run-as-root --oversubscribe)
adam=(--set optimizer.type=adam --set optimizer.lr=0.001 --set train.log_interval=1000 --set train.eval_interval=0)

echo "== optimizer state per device, configs/mlp.yaml with Adam (K=1), 5 steps"
for d in 1 2 4; do
  out="$tmp/state_d$d"
  cmd=("$gpipe" train "$config" "${adam[@]}" --set pipeline.partitions=1 --set pipeline.micro_batches=4
       --set pipeline.replicas="$d" --set train.steps=5 --set train.batch_size=64 --set output.dir="$out")
  if [ "$d" -gt 1 ]; then
    "${mpirun[@]}" -np "$d" "${cmd[@]}" --set pipeline.shard_optimizer=optimizer > "$out.log" 2>&1
  else
    "${cmd[@]}" > "$out.log" 2>&1
  fi
  planned="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['prediction']['stages'][0]['optimizer_bytes'])" "$out/report.json")"
  measured="$(grep -oE 'optimizer state [0-9]+ bytes' "$out.log" | awk '{print $3}' | sort -u | tr '\n' ' ' || true)"
  echo "D=$d: planned $planned bytes per device; measured per rank: ${measured:-(one process, no replicas: see the plan)}"
done

echo "== step time at K=2 x D=2 (4 processes on $(nproc) cores), 40 steps; step: report.json's step_ms, the mean wall time of the timed steps"
for r in $(seq "$repeats"); do
  for mode in none optimizer; do
    out="$tmp/k2d2_${mode}_$r"
    "${mpirun[@]}" -np 4 "$gpipe" train "$config" "${adam[@]}" --set pipeline.replicas=2 --set train.batch_size=128 \
      --set train.steps=40 --set pipeline.shard_optimizer="$mode" --set output.dir="$out" > "$out.log" 2>&1
    python3 - "$out/report.json" "$mode" "$r" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
st = j["stages"]
coll = " ".join("%.2f" % s.get("collective_ms", 0) for s in st)
opt = " ".join("%.2f" % s.get("optimizer_ms", 0) for s in st)
print("run %s %-9s step %.2f ms  collectives per stage %s ms  optimizer per stage %s ms  optimizer state planned %s B/device"
      % (sys.argv[3], sys.argv[2], j["step_ms"], coll, opt, [s["optimizer_bytes"] for s in j["prediction"]["stages"]]))
PY
  done
done
echo "(outputs in $tmp)"
