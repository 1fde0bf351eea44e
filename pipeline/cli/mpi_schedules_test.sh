#!/usr/bin/env bash
# Every schedule trains to the same losses as GPipe, in one process and across
# processes (mpirun --oversubscribe, one stage per rank, MPI transport with non-blocking
# sends in schedule order): 1F1B and interleaved 1F1B at K = 2 and at K = 2 x D = 2,
# zero bubble in one process. The model is a float64 language model with dropout and a
# head tied to its embedding, so every random stream and the tied gradient's exchange
# must not depend on the schedule, the split or the process. Per-step losses and the
# validation loss and accuracy are compared at full precision from report.json.
set -uo pipefail
gpipe="$1"
tmp="${TEST_TMPDIR:-/tmp}"
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)

for i in $(seq 300); do echo "line $i: pipelines of the quick brown fox $((i * 37 % 101)) jump $((i * 13 % 7))"; done > "$tmp/text.txt"
cat > "$tmp/lm.yaml" <<YAML
model:
  input: [16]
  dtype: float64
  layers:
    - {type: embedding, vocab: 256, dim: 16}
    - repeat: 4
      layers:
        - {type: transformer_block, heads: 2, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 256, bias: false, tied: true}
  loss: {type: softmax_cross_entropy}
data: {type: text, path: $tmp/text.txt, seq_len: 16}
pipeline: {partitions: 2, micro_batches: 4, recompute: except_last}
optimizer: {type: adamw, lr: 0.003, clip_grad_norm: 1.0}
train: {steps: 6, batch_size: 16, log_interval: 1}
YAML

run() {  # name, processes, then --set overrides
  local name="$1" np="$2"
  shift 2
  local cmd=("$gpipe" train "$tmp/lm.yaml" --set output.dir="$tmp/$name" "$@")
  if [ "$np" -gt 1 ]; then cmd=("${mpirun[@]}" -np "$np" "${cmd[@]}"); fi
  "${cmd[@]}" > "$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; echo "FAIL: $name"; exit 1; }
}

same_losses() {  # reference run, other run: six per-step losses and the validation equal to 1e-10 relative
  python3 - "$tmp/$1/report.json" "$tmp/$2/report.json" <<'PY' || { echo "FAIL: $2's losses differ from $1's"; exit 1; }
import json, sys
ra, rb = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
a = [s["loss"] for s in ra["steps"]]
b = [s["loss"] for s in rb["steps"]]
assert len(a) == 6 and len(b) == 6, (a, b)
for i, (x, y) in enumerate(zip(a, b)):
    assert abs(x - y) <= 1e-10 * abs(x), f"step {i}: {x!r} vs {y!r}"
# Validation runs each schedule's forward-only program on the executor.
for key in ("loss", "accuracy"):
    x, y = ra["eval"][key], rb["eval"][key]
    assert abs(x - y) <= 1e-10 * abs(x), f"validation {key}: {x!r} vs {y!r}"
PY
  echo "ok: $2 gives $1's six losses and validation"
}

run gpipe 1
run 1f1b 1 --set pipeline.schedule=1f1b
run zero_bubble 1 --set pipeline.schedule=zero_bubble
run interleaved 1 --set pipeline.schedule=interleaved_1f1b --set pipeline.virtual_stages=2
same_losses gpipe 1f1b
same_losses gpipe zero_bubble
same_losses gpipe interleaved

run 1f1b_np2 2 --set pipeline.schedule=1f1b
run interleaved_np2 2 --set pipeline.schedule=interleaved_1f1b --set pipeline.virtual_stages=2
run 1f1b_np4 4 --set pipeline.schedule=1f1b --set pipeline.replicas=2 --set pipeline.bucket_mb=0.01
run interleaved_np4 4 --set pipeline.schedule=interleaved_1f1b --set pipeline.virtual_stages=2 --set pipeline.replicas=2
same_losses gpipe 1f1b_np2
same_losses gpipe interleaved_np2
same_losses gpipe 1f1b_np4
same_losses gpipe interleaved_np4
grep -q '"schedule": "interleaved_1f1b"' "$tmp/interleaved_np2/report.json" || { echo "FAIL: report names the schedule"; exit 1; }
echo "all schedules agree"
