#!/usr/bin/env bash
# bfloat16 against float32 on the default config (issue 23): step time, peak activation
# memory per stage and bytes sent between the stages per step, from the runs' own
# report.json and trace.json. The precisions alternate (float32, bf16, float32, bf16,
# ...) so that a drift of the machine's speed falls on both; the step time is the
# median over the rounds of each run's timed mean.
#
#   bench/mixed_precision.sh [--rounds N] [--steps S]     (defaults: 2 rounds of 40 steps)
#
# Needs bazel-bin/pipeline/gpipe (bazel build //pipeline:gpipe). Figures: bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
rounds=2 steps=40
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    *) echo "usage: bench/mixed_precision.sh [--rounds N] [--steps S]" >&2; exit 2 ;;
  esac
done
gpipe=bazel-bin/pipeline/gpipe
[ -x "$gpipe" ] || { echo "build it first: bazel build //pipeline:gpipe" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$rounds"); do
  for p in float32 bf16; do
    "$gpipe" train configs/default.yaml --set model.dtype=$p --set train.steps="$steps" \
      --set train.eval_interval=100000 --set train.log_interval=100000 --set output.dir="$tmp/$p-$r" \
      > "$tmp/$p-$r.log" 2>&1 || { cat "$tmp/$p-$r.log"; exit 1; }
  done
done
python3 - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
def one(d):
    r = json.load(open(d + "/report.json"))
    t = json.load(open(d + "/trace.json"))
    ev = t["traceEvents"] if isinstance(t, dict) else t
    sends = [e for e in ev if e.get("cat", "").startswith("send_")]
    steps = {e["args"]["step"] for e in sends}
    per_step = sum(e["args"]["bytes"] for e in sends) / max(len(steps), 1)
    return r["step_ms"], [s["peak_activation_bytes"] for s in r["stages"]], per_step
res = {}
for p in ("float32", "bf16"):
    runs = [one(f"{tmp}/{p}-{i}") for i in range(1, rounds + 1)]
    res[p] = (statistics.median(x[0] for x in runs), runs[0][1], runs[0][2], [x[0] for x in runs])
f, b = res["float32"], res["bf16"]
print(f"{'':24}{'float32':>14}{'bf16':>14}{'bf16/float32':>14}")
print(f"{'step ms (median)':24}{f[0]:14.1f}{b[0]:14.1f}{b[0] / f[0]:14.3f}")
for k in range(len(f[1])):
    print(f"{'peak act MiB stage ' + str(k):24}{f[1][k] / 2**20:14.2f}{b[1][k] / 2**20:14.2f}{b[1][k] / f[1][k]:14.3f}")
print(f"{'sent MiB per step':24}{f[2] / 2**20:14.2f}{b[2] / 2**20:14.2f}{b[2] / f[2]:14.3f}")
print("step ms per round: float32", ", ".join(f"{x:.1f}" for x in f[3]), "| bf16", ", ".join(f"{x:.1f}" for x in b[3]))
PY
