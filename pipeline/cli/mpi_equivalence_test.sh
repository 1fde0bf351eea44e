#!/usr/bin/env bash
# Processes change nothing but speed, in float64, at full precision (report.json's
# per-step losses and final evaluation, compared by compare_reports):
#  1. K = 3 under mpirun (a middle stage whose neighbours are both other processes)
#     gives bit for bit the losses of the same pipeline as threads of one process;
#  2. K = 1 x D = 2 and K = 2 x D = 3 (6 ranks on 2 cores), with gradient buckets of
#     0 (one reduction per parameter), a few KB (several per stage) and larger than
#     any stage (one), and K = 3 x D = 2, give the single-process losses to 1e-12
#     (summing over replicas reorders float64 additions, nothing more);
#  3. the comparison itself notices a different run (a control that must fail).
set -uo pipefail
gpipe="$1"
compare="$2"
tmp="${TEST_TMPDIR:-/tmp}/mpi_equivalence"
mkdir -p "$tmp"
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)

# A small float64 MLP with dropout, AdamW, warm-up, cosine decay and clipping: every
# promise at once. Dropout's masks are keyed by each sample's place in the whole
# mini-batch, so replicas, stages and micro-batches draw the same ones.
cat > "$tmp/mlp64.yaml" <<EOF
model:
  input: [32]
  dtype: float64
  layers:
    - {type: linear, out: 64}
    - {type: gelu}
    - {type: dropout, p: 0.2}
    - {type: linear, out: 64}
    - {type: relu}
    - {type: linear, out: 64}
    - {type: gelu}
    - {type: dropout, p: 0.1}
    - {type: linear, out: 64}
    - {type: relu}
    - {type: linear, out: 6}
  loss: {type: softmax_cross_entropy}
data: {type: teacher, classes: 6, teacher_hidden: 16, seed: 3, eval_samples: 96}
pipeline: {partitions: 1, micro_batches: 2}
optimizer: {type: adamw, lr: 0.01, weight_decay: 0.01, schedule: cosine, warmup_steps: 2, clip_grad_norm: 0.5}
train: {steps: 6, batch_size: 24, log_interval: 1, eval_interval: 3}
EOF
config="$tmp/mlp64.yaml"

# single NAME K [--set ...]: one process, K stages as threads.
single() {
  local name="$1" k="$2"; shift 2
  "$gpipe" train "$config" --set pipeline.partitions="$k" --set output.dir="$tmp/$name" "$@" > "$tmp/$name.log" 2>&1 ||
    { cat "$tmp/$name.log"; echo "FAIL: single-process run $name"; exit 1; }
}
# multi NAME NP K D BUCKET_MB: one process per stage and replica.
multi() {
  local name="$1" np="$2" k="$3" d="$4" bucket="$5"
  "${mpirun[@]}" -np "$np" "$gpipe" train "$config" --set pipeline.partitions="$k" --set pipeline.replicas="$d" \
    --set pipeline.bucket_mb="$bucket" --set output.dir="$tmp/$name" > "$tmp/$name.log" 2>&1 ||
    { cat "$tmp/$name.log"; echo "FAIL: mpirun -np $np ($name)"; exit 1; }
  [ "$(grep -c '^step ' "$tmp/$name.log")" -eq 6 ] ||
    { cat "$tmp/$name.log"; echo "FAIL: $name: expected 6 step lines, from one rank only"; exit 1; }
}
# same REFERENCE RUN RTOL WHAT
same() {
  if ! "$compare" "$tmp/$1/report.json" "$tmp/$2/report.json" "$3" > "$tmp/$2.cmp"; then
    cat "$tmp/$2.cmp" "$tmp/$2.log"; echo "FAIL: $4 differs from one process (rtol $3)"; exit 1
  fi
  echo "ok: $4 gives the single-process losses and evaluation (rtol $3)"
}

single s1 1
single s2 2
single s3 3

multi k3 3 3 1 25
same s3 k3 0 "K=3 on 3 processes"

for bucket in 0 0.01 1000; do
  multi k1d2_$bucket 2 1 2 "$bucket"
  same s1 k1d2_$bucket 1e-12 "K=1 x D=2, bucket_mb=$bucket"
done
for bucket in 0.01 1000; do
  multi k2d3_$bucket 6 2 3 "$bucket"
  same s2 k2d3_$bucket 1e-12 "K=2 x D=3 (6 ranks), bucket_mb=$bucket"
done
multi k3d2 6 3 2 0.02
same s3 k3d2 1e-12 "K=3 x D=2 (6 ranks), bucket_mb=0.02"

# The control: another learning rate must not pass as the same run.
single s1_other 1 --set optimizer.lr=0.0101
if "$compare" "$tmp/s1/report.json" "$tmp/s1_other/report.json" 1e-12 > "$tmp/control.cmp"; then
  cat "$tmp/control.cmp"; echo "FAIL: compare_reports took a different run for the same"; exit 1
fi
echo "ok: the comparison tells a different run apart"
