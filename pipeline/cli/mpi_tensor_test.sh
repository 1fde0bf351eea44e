#!/usr/bin/env bash
# Tensor parallelism (pipeline.tensor_parallel: T) under mpirun, K x T x D processes, in
# float64 at full precision (report.json's losses and evaluation, compare_reports):
#  1. a GPT config (a tied head, dropout) at K in {1, 2}, T in {2, 4}, D in {1, 2} (the
#     optimizer sharded at K=2 x T=2 x D=2) and a LLaMA config (grouped-query attention,
#     dropout) at K=1 x T=2, K=2 x T=2 and K=1 x T=4 x D=2, and with 2 key/value heads
#     (each replicated over 2 members) at K=2 x T=4, give the one-process losses
#     and evaluation to 1e-12 with AdamW and clipping; each process holds its blocks of
#     the split layers (fewer parameters than the whole model, the log says how many);
#     with sequence parallelism (pipeline.sequence_parallel) GPT at K=1 x T=2, K=2 x T=4
#     and K=2 x T=2 x D=2 sharded, LLaMA at K=1 x T=4 x D=2, the same;
#  2. a checkpoint saved at K=2 x T=2 is whole by name (the unsplit model's shapes,
#     read with Python's safetensors layout) and resumes in one process (T=1) and at
#     K=1 x T=4 with the uninterrupted run's losses (1e-12);
#  3. pipeline.memory_limit: a limit the whole stage is over is refused at T=1 (naming
#     pipeline.tensor_parallel), and the same run trains at T=2, each process under it;
#  4. clear errors: T > 1 on GPUs in one process, the wrong process count, a vocabulary T
#     does not divide;
#  5. a member killed with kill -9 mid-run: gpipe run restarts the job from its newest
#     checkpoint and it ends with the losses of the run that was not killed;
#  6. gpipe plan at T=2 counts the whole model's parameters and each member's as the run
#     held them; gpipe plan --sweep tries T and, where no plan fits at T=1 (an MLP whose
#     layers are each over the limit), recommends T > 1, which trains;
#  7. without mpirun, T > 1 runs the job's ranks as threads of one process (GPT at K=1 x
#     T=4, K=2 x T=2 and K=2 x T=2 x D=2 sharded, with sequence parallelism at K=2 x T=2):
#     the same losses;
#  8. trace.json holds each tensor-group collective of the program as a slice of its own,
#     with its bytes, inside the compute slice that ran it, whose tensor_group_ms is theirs.
set -uo pipefail
gpipe="$(realpath "$1")"
compare="$(realpath "$2")"
tmp="${TEST_TMPDIR:-/tmp}/mpi_tensor"
rm -rf "$tmp"
mkdir -p "$tmp"
cd "$tmp" || exit 1
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)
fail() { echo "FAIL: $*"; exit 1; }

python3 - > text.txt <<'PY'
import random
random.seed(1)
words = ["the", "pipeline", "stage", "tensor", "group", "sum", "split", "model", "layer", "batch"]
print(" ".join(random.choice(words) for _ in range(3000)))
PY
cat > gpt64.yaml <<YAML
model:
  input: [16]
  input_dtype: int32
  dtype: float64
  layers:
    - {type: embedding, vocab: 256, dim: 32}
    - repeat: 2
      layers:
        - {type: transformer_block, heads: 4, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 256, tied: true, bias: false}
YAML
cat > llama64.yaml <<YAML
model:
  input: [16]
  input_dtype: int32
  dtype: float64
  layers:
    - {type: embedding, vocab: 256, dim: 32, positions: 0}
    - repeat: 2
      layers:
        - {type: llama_block, heads: 8, kv_heads: 4, hidden: 48, dropout: 0.1}
    - {type: rmsnorm}
    - {type: linear, out: 256, bias: false}
YAML
# Both models' loss, data and training: the same text, AdamW with clipping.
for f in gpt64.yaml llama64.yaml; do
  cat >> "$f" <<YAML
  loss: softmax_cross_entropy
data: {type: text, path: $tmp/text.txt, seq_len: 16, eval_samples: 32}
pipeline: {partitions: 1, micro_batches: 2}
optimizer: {type: adamw, lr: 0.01, weight_decay: 0.01, clip_grad_norm: 0.5}
train: {steps: 4, batch_size: 8, log_interval: 1}
YAML
done

# run NAME CONFIG K T D [--set ...]: K x T x D processes (1: plainly).
run() {
  local name="$1" config="$2" K="$3" T="$4" D="$5"; shift 5
  local np=$((K * T * D))
  local cmd=("$gpipe" train "$config" --set output.dir="$tmp/$name" --set pipeline.partitions="$K"
             --set pipeline.tensor_parallel="$T" --set pipeline.replicas="$D" "$@")
  if [ "$np" -gt 1 ]; then cmd=("${mpirun[@]}" -np "$np" "${cmd[@]}"); fi
  "${cmd[@]}" > "$name.log" 2>&1 || { cat "$name.log"; fail "run $name ($np processes)"; }
}
# same REFERENCE RUN WHAT: every step's loss and the evaluation within 1e-12.
same() {
  "$compare" "$1/report.json" "$2/report.json" 1e-12 > "$2.cmp" || { cat "$2.cmp" "$2.log"; fail "$3 differs from $1"; }
  echo "ok: $3"
}
# held LOG T: every rank logs the parameters it holds, fewer than the whole model's.
held() {
  python3 - "$1" "$2" <<'PY' || fail "parameters held per process in $1"
import re, sys
log, T = sys.argv[1], int(sys.argv[2])
found = re.findall(r"(?:member \d+/(\d+)): this process holds (\d+) of the model's (\d+) parameters", open(log).read())
assert found, "no member says what it holds"
for t, mine, whole in found:
    assert int(t) == T and 0 < int(mine) < int(whole), (t, mine, whole)
PY
}

# 1. Every layout equals one process.
run g1 gpt64.yaml 1 1 1
for layout in "1 2 1" "1 4 1" "2 2 1" "2 4 1" "1 2 2" "2 2 2" "1 4 2"; do
  read -r K T D <<< "$layout"
  run "g$K$T$D" gpt64.yaml "$K" "$T" "$D"
  same g1 "g$K$T$D" "GPT (tied head, dropout) at K=$K x T=$T x D=$D"
done
held g121.log 2
# The report: each stage's time in its tensor group's sums, measured and planned (0 whole).
python3 - g221/report.json g1/report.json <<'PY' || fail "report.json's tensor_group_ms"
import json, sys
split, whole = (json.load(open(p)) for p in sys.argv[1:])
for part in (split["stages"], split["prediction"]["stages"]):
    for s in part:
        assert 0 < s["tensor_group_ms"] <= s["comm_ms"] + 1e-9, s
for part in (whole["stages"], whole["prediction"]["stages"]):
    for s in part:
        assert s["tensor_group_ms"] == 0, s
PY
grep -q "Tensor group's collectives, waits for the other members included (in comm ms, not in fwd, recomp or bwd): stage 0" g221.log || { cat g221.log; fail "the table's tensor group line"; }
# The trace: each compute slice's time in the group's collectives, within the slice; the
# page: a tensor group column.
python3 - g221/trace.json <<'PY' || fail "trace.json's tensor_group_ms"
import json, sys
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
grouped = [e for e in events if "tensor_group_ms" in e.get("args", {})]
assert grouped, "no slice says its tensor group time"
for e in grouped:
    assert e["cat"] in ("forward", "recompute", "backward", "weight_gradient"), e
    assert 0 < e["args"]["tensor_group_ms"] * 1e3 <= e["dur"] + 1, e
PY
grep -q "<th>tensor group</th>" g221/report.html || fail "the page has no tensor group column"
# 8. Each of the program's tensor-group collectives is a slice of its own (every rank's,
# gathered to the first), with its bytes, inside one compute slice of its stage and step on
# the communication track, and a compute slice's tensor_group_ms is its collectives' time.
python3 - g221/trace.json <<'PY' || fail "trace.json's tensor-group collectives"
import json, sys
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
compute = [e for e in events if e["cat"] in ("forward", "recompute", "backward", "weight_gradient")]
collectives = [e for e in events if e["cat"].startswith("tensor_")]
assert collectives, "no tensor collective slice"
inside = {}
for c in collectives:
    assert c["name"][:3] in ("tAR", "tMA", "tAG", "tRS"), c
    assert c["args"]["bytes"] > 0, c
    owners = [e for e in compute if e["pid"] == c["pid"] and e["args"]["step"] == c["args"]["step"]
              and e["args"].get("micro_batch") == c["args"].get("micro_batch")
              and e["ts"] - 0.01 <= c["ts"] and c["ts"] + c["dur"] <= e["ts"] + e["dur"] + 0.01]
    assert len(owners) == 1, (c, owners)
    assert owners[0]["tid"] != c["tid"], (c, owners[0])
    key = (owners[0]["pid"], owners[0]["ts"])
    inside[key] = inside.get(key, 0.0) + c["dur"]
for e in compute:
    got = inside.get((e["pid"], e["ts"]), 0.0)
    want = e["args"].get("tensor_group_ms", 0.0) * 1e3
    assert abs(got - want) <= 0.01 * 40 + 1e-6 * want, (e, got)
PY
echo "ok: trace.json holds the tensor-group collectives inside their compute slices"
grep -q '"tensor_parallel": 2' g121/report.json || fail "report.json does not say tensor_parallel"
run g222s gpt64.yaml 2 2 2 --set pipeline.shard_optimizer=optimizer
same g1 g222s "GPT at K=2 x T=2 x D=2 with the optimizer state sharded"
run l1 llama64.yaml 1 1 1
for layout in "1 2 1" "2 2 1" "1 4 2"; do
  read -r K T D <<< "$layout"
  run "l$K$T$D" llama64.yaml "$K" "$T" "$D"
  same l1 "l$K$T$D" "LLaMA (grouped-query attention, dropout) at K=$K x T=$T x D=$D"
done
held l142.log 4
# Two key/value heads over four members: each replicated over the two its query heads use.
sed 's/kv_heads: 4/kv_heads: 2/' llama64.yaml > llama64kv2.yaml
run k1 llama64kv2.yaml 1 1 1
run k241 llama64kv2.yaml 2 4 1
same k1 k241 "LLaMA with 2 key/value heads replicated over pairs of members at K=2 x T=4"
# Sequence parallelism: each member holds its share of the positions between the split
# layers (its messages to the next stage too), the same losses and evaluation.
seq=(--set pipeline.sequence_parallel=true)
for layout in "1 2 1" "2 4 1"; do
  read -r K T D <<< "$layout"
  run "gs$K$T$D" gpt64.yaml "$K" "$T" "$D" "${seq[@]}"
  same g1 "gs$K$T$D" "GPT with sequence parallelism at K=$K x T=$T x D=$D"
done
run gs222 gpt64.yaml 2 2 2 --set pipeline.shard_optimizer=optimizer "${seq[@]}"
same g1 gs222 "GPT with sequence parallelism at K=2 x T=2 x D=2, the optimizer state sharded"
run ls142 llama64.yaml 1 4 2 "${seq[@]}"
same l1 ls142 "LLaMA with sequence parallelism at K=1 x T=4 x D=2"
grep -q "sequence parallelism: member 0 holds positions 0 to 3 of each sample's 16" ls142.log ||
  { cat ls142.log; fail "the log does not say which positions a member holds"; }
grep -q '"sequence_parallel": true' gs121/report.json || fail "report.json does not say sequence_parallel"
# gpipe plan plans a member's share of the positions: less activation memory than without.
"$gpipe" plan gpt64.yaml --set pipeline.tensor_parallel=2 > planT.txt 2>&1 || { cat planT.txt; fail "gpipe plan at T=2"; }
"$gpipe" plan gpt64.yaml --set pipeline.tensor_parallel=2 "${seq[@]}" > planS.txt 2>&1 ||
  { cat planS.txt; fail "gpipe plan with sequence parallelism"; }
grep -q "each member holds 1/2 of each sample's positions" planS.txt || { cat planS.txt; fail "plan: no sequence parallelism"; }
python3 - planT.txt planS.txt <<'PY' || fail "sequence parallelism plans no less activation memory"
import re, sys
def activations(path):
    text = open(path).read()
    m = re.search(r"stage 0 on \S+: memory .*activations ([0-9.]+) (B|KiB|MiB|GiB)\)", text)
    assert m, text
    return float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
plain, seq = activations(sys.argv[1]), activations(sys.argv[2])
assert seq < plain, (seq, plain)
PY
# The sweep tries each T > 1 with sequence parallelism too ("T=2 seq"): the same plan
# with it holds no more than without it (here, with 16 positions, less).
"$gpipe" plan gpt64.yaml --sweep --devices 4 --rows 2000 > sweepS.txt 2>&1 || { cat sweepS.txt; fail "the sweep at 4 devices"; }
python3 - sweepS.txt <<'PY' || { cat sweepS.txt; fail "the sweep's sequence-parallel candidates"; }
import re, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"\s+\d+\s+(K=.*?)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s", line)
    if m:
        rows[m.group(1)] = float(m.group(5))
seq = {k: v for k, v in rows.items() if k.endswith(" seq")}
assert any(" T=2 seq" in k for k in seq) and any(" T=4 seq" in k for k in seq), sorted(rows)[:10]
smaller = 0
for k, peak in seq.items():
    plain = k[: -len(" seq")]
    assert plain in rows, plain
    assert peak <= rows[plain], (k, peak, rows[plain])
    smaller += peak < rows[plain]
assert smaller > 0, "no sequence-parallel plan holds less"
PY
grep -q "T=2 seq: " sweepS.txt || fail "the sweep's costs do not name T=2 with sequence parallelism"
# A sequence T does not divide: named, with its fix.
"${mpirun[@]}" -np 3 "$gpipe" train gpt64.yaml --set output.dir="$tmp/es1" --set pipeline.tensor_parallel=3 \
  "${seq[@]}" > es1.log 2>&1 && fail "16 positions split over 3"
grep -q "positions does not split into 3 equal shares" es1.log || { cat es1.log; fail "the message for 16 positions over 3"; }

# gpipe plan at T=2: the whole model's parameters and each member's, as the run held them.
"$gpipe" plan gpt64.yaml --set pipeline.tensor_parallel=2 > plan2.txt 2>&1 || { cat plan2.txt; fail "gpipe plan at T=2"; }
python3 - plan2.txt g121.log <<'PY' || fail "gpipe plan's parameter counts at T=2"
import re, sys
plan, log = open(sys.argv[1]).read(), open(sys.argv[2]).read()
whole, member = map(int, re.search(r"model: \d+ layers, (\d+) parameters \(each of a stage's 2 processes holds (\d+)\)", plan).groups())
held = re.findall(r"member (\d)/2: this process holds (\d+) of the model's (\d+) parameters", log)
assert len(held) == 2, held
for m, mine, all_ in held:
    assert int(mine) == member and int(all_) == whole, (m, mine, all_, member, whole)
assert "priced over this machine's MPI link" in plan
PY
echo "ok: gpipe plan at T=2 shows the whole model's parameters and each member's, as the run held them"
"$gpipe" plan gpt64.yaml --set pipeline.tensor_parallel=2 --devices 4 > plan4.txt 2>&1 || { cat plan4.txt; fail "plan --devices 4 at T=2"; }
grep -q "Plan for 4 devices (2 stages x T = 2) like this machine's" plan4.txt || { cat plan4.txt; fail "plan --devices 4 at T=2"; }
"$gpipe" plan gpt64.yaml --set pipeline.tensor_parallel=2 --devices 3 > plan3.txt 2>&1 && fail "3 devices planned at T=2"
grep -q "does not split into stages of pipeline.tensor_parallel = 2 devices each" plan3.txt || { cat plan3.txt; fail "plan --devices 3 at T=2"; }
echo "ok: gpipe plan --devices N at T=2 plans N / 2 stages, and refuses an N that T does not divide"

# The sweep tries T: an MLP whose layers each hold more than the memory limit allows fits
# no plan at T=1 (whatever K) and is recommended split; its recommendation trains.
cat > mlp.yaml <<YAML
model:
  input: [12]
  dtype: float64
  layers:
    - {type: linear, out: 512, parallel: column}
    - {type: gelu}
    - {type: linear, out: 12, parallel: row}
  loss: softmax_cross_entropy
data: {type: teacher, classes: 12, teacher_hidden: 8, seed: 3, eval_samples: 48}
pipeline: {partitions: 1, micro_batches: 2, memory_limit: 150KB}
optimizer: {type: adamw, lr: 0.01}
train: {steps: 4, batch_size: 8}
YAML
# On 2 devices, under a limit only T=2 plans meet: the sweep times them here, each member
# of the tensor group a thread, and recommends the measured fastest.
"$gpipe" plan mlp.yaml --sweep --devices 2 --set pipeline.memory_limit=240KB > sweep2.txt 2>&1 ||
  { cat sweep2.txt; fail "the sweep at 2 devices"; }
python3 - sweep2.txt <<'PY' || { cat sweep2.txt; fail "the sweep did not time its T=2 plans"; }
import re, sys
text = open(sys.argv[1]).read()
timed = re.findall(r"^  (K=\S+ M=\d+ .*? T=2)\s+predicted\s+([0-9.]+) ms, measured\s+([0-9.]+) ms", text, re.M)
assert timed, "no T=2 plan timed"
assert all(float(m) > 0 for _, _, m in timed), timed
best = re.search(r"^\s+\d+\s+(K=.*?)\s{2,}.*<< recommended \(measured fastest\)", text, re.M)
assert best and " T=2" in best.group(1), best
PY
echo "ok: the sweep times T=2 plans as threads and recommends the measured fastest"
# A config that sets T=2 itself: its own plan is timed too (as threads), not left to gpipe run.
"$gpipe" plan gpt64.yaml --sweep --devices 2 --set pipeline.tensor_parallel=2 > sweepOwn.txt 2>&1 ||
  { cat sweepOwn.txt; fail "the sweep of a T=2 config"; }
python3 - sweepOwn.txt <<'PY' || { cat sweepOwn.txt; fail "the sweep did not time a T=2 config's own plan"; }
import re, sys
text = open(sys.argv[1]).read()
own = re.search(r"^\s+\d+\s+(K=\S+ .*? T=2)\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+\s+.*the config's own plan", text, re.M)
assert own and float(own.group(2)) > 0, own
PY
echo "ok: a T=2 config's own plan is timed by the sweep"
# One whose K x T is more than the sweep's devices: its own plan is still its T=2 plan, with
# the member's memory that gpipe plan shows.
"$gpipe" plan gpt64.yaml --sweep --devices 2 --set pipeline.tensor_parallel=2 --set pipeline.partitions=2 \
  > sweepOwn2.txt 2>&1 || { cat sweepOwn2.txt; fail "the sweep of a K=2 x T=2 config"; }
"$gpipe" plan gpt64.yaml --set pipeline.tensor_parallel=2 --set pipeline.partitions=2 > planOwn2.txt 2>&1 ||
  { cat planOwn2.txt; fail "the plan of a K=2 x T=2 config"; }
python3 - sweepOwn2.txt planOwn2.txt <<'PY' || { cat sweepOwn2.txt planOwn2.txt; fail "the sweep's own K=2 x T=2 plan"; }
import re, sys
text, plan = (open(p).read() for p in sys.argv[1:])
# rank, plan, predicted ms, measured ms, samples/s, bubble, peak MiB
own = re.search(r"^\s+\d+\s+(K=2 .*? T=2)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)\s+.*the config's own plan",
                text, re.M)
assert own, "no K=2 x T=2 own row"
fullest = re.search(r"the fullest device holds ([0-9.]+) (KiB|MiB)", plan)
mib = float(fullest.group(1)) / (1024 if fullest.group(2) == "KiB" else 1)
assert abs(float(own.group(2)) - mib) < 0.06, (own.group(0), fullest.group(0))
PY
echo "ok: a K=2 x T=2 config's own plan in the sweep is its T=2 plan"
"$gpipe" plan mlp.yaml --sweep --devices 4 --rows 500 > sweep4.txt 2>&1 || { cat sweep4.txt; fail "the sweep over T"; }
recommended=$(python3 - sweep4.txt <<'PY'
import re, sys
rows = [l for l in open(sys.argv[1]) if re.match(r"\s+\d+\s+K=", l)]
label = lambda l: re.match(r"\s+\d+\s+(K=.*?)\s{2,}", l).group(1)
whole = [l for l in rows if " T=" not in label(l)]
split = [l for l in rows if " T=" in label(l)]
assert whole and split, (len(whole), len(split))
for l in whole:
    assert "memory:" in l, l  # no T=1 plan fits
for l in rows:  # every plan within the 4 devices: K x T (one replica)
    K = int(re.search(r"K=(\d+)", label(l)).group(1))
    T = int(re.search(r" T=(\d+)", label(l)).group(1)) if " T=" in label(l) else 1
    assert K * T <= 4, l
best = [l for l in rows if "<< recommended" in l]
assert len(best) == 1 and re.search(r" T=(2|4) ", best[0]), best
text = open(sys.argv[1]).read()
print(re.search(r"Recommended: .*\n  (.*)\n", text).group(1))
PY
) || { cat sweep4.txt; fail "the sweep does not recommend T > 1 where no T=1 plan fits"; }
read -r -a sets <<< "$recommended"
K=$(grep -o "pipeline.partitions=[0-9]*" <<< "$recommended" | cut -d= -f2)
T=$(grep -o "pipeline.tensor_parallel=[0-9]*" <<< "$recommended" | cut -d= -f2)
"${mpirun[@]}" -np $((K * T)) "$gpipe" train mlp.yaml --set output.dir="$tmp/sw" "${sets[@]}" > sw.log 2>&1 ||
  { cat sw.log; fail "the sweep's recommendation ($recommended) does not train"; }
"$gpipe" train mlp.yaml --set output.dir="$tmp/sw1" > sw1.log 2>&1 && fail "the MLP trained whole over its memory limit"
echo "ok: the sweep tries T, finds no plan at T=1 under the limit, recommends K=$K x T=$T, which trains"

# 2. A checkpoint saved split is whole by name and resumes at another T and K.
run ck gpt64.yaml 2 2 1 --set checkpoint.every=2
python3 - ck/checkpoints/step-2 <<'PY' || fail "the checkpoint saved at T=2 is not whole by name"
import json, os, struct, sys
d = sys.argv[1]
shapes = {}
for f in os.listdir(d):
    if f.startswith("model") and f.endswith(".safetensors"):
        with open(os.path.join(d, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            for k, v in json.loads(fh.read(n)).items():
                if k != "__metadata__":
                    shapes[k] = v["shape"]
want = {"layers.0.token": [256, 32], "layers.1.attn.qkv.weight": [96, 32], "layers.1.attn.proj.weight": [32, 32],
        "layers.2.fc1.weight": [128, 32], "layers.2.fc2.weight": [32, 128], "layers.2.fc1.bias": [128]}
for k, s in want.items():
    assert shapes.get(k) == s, (k, shapes.get(k), s, sorted(shapes))
PY
echo "ok: a checkpoint saved at T=2 holds the unsplit model's tensors by name"
run r111 gpt64.yaml 1 1 1 --set checkpoint.resume="$tmp/ck/checkpoints/step-2"
same g1 r111 "saved at K=2 x T=2, resumed in one process"
run r141 gpt64.yaml 1 4 1 --set checkpoint.resume="$tmp/ck/checkpoints/step-2"
same g1 r141 "saved at K=2 x T=2, resumed at K=1 x T=4"

# A member killed (kill -9) mid-run: gpipe run restarts the job from its newest checkpoint,
# and the run ends with the uninterrupted run's losses (at the same T: over 600 AdamW steps
# the sums' order, T=2 against one process, moves the losses by more than 1e-12).
run long2 gpt64.yaml 1 2 1 --set train.steps=600
( timeout 300 "$gpipe" run --np 2 gpt64.yaml --set output.dir="$tmp/killed" --set pipeline.tensor_parallel=2 \
    --set train.steps=600 --set checkpoint.every=100 > killed.log 2>&1; echo "rc=$?" >> killed.log ) &
job=$!
for _ in $(seq 600); do [ -e "$tmp/killed/checkpoints/step-100/COMPLETE" ] && break; sleep 0.1; done
victim=""  # member 1 of this job (its output.dir names it)
for pid in $(pgrep -f "gpipe train gpt64.yaml --set output.dir=$tmp/killed"); do
  if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then victim=$pid; fi
done
[ -n "$victim" ] && kill -9 "$victim"
wait "$job"
[ "$(tail -1 killed.log)" = "rc=0" ] || { cat killed.log; fail "the job with a killed member did not finish"; }
if ! grep -q "restart 1 of" killed.log; then
  # Nothing restarted: only right when the job's last step had run before member 1 was found.
  grep -q "step   600/600" killed.log || { cat killed.log; fail "member 1 (${victim:-not found}) was not restarted"; }
fi
same long2 killed "a member killed by kill -9, the job restarted from its checkpoint (T=2)"
echo "  (member 1 killed: ${victim:-no, the run had ended}; restarts: $(grep -c 'restart 1 of' killed.log))"

# 3. The memory limit: over it whole, under it at T=2.
limit=(--set pipeline.memory_limit=1500KB)
"$gpipe" train gpt64.yaml --set output.dir="$tmp/m1" "${limit[@]}" > m1.log 2>&1 && fail "a stage over pipeline.memory_limit trained at T=1"
grep -q "over pipeline.memory_limit" m1.log && grep -q "pipeline.tensor_parallel: 2" m1.log ||
  { cat m1.log; fail "the refusal at T=1 does not name pipeline.tensor_parallel"; }
run m2 gpt64.yaml 1 2 1 "${limit[@]}"
same g1 m2 "over pipeline.memory_limit whole, trained at T=2"

# 4. Clear errors.
"$gpipe" train gpt64.yaml --set output.dir="$tmp/e4" --set pipeline.tensor_parallel=2 --set 'pipeline.devices=[cuda]' \
  > e4.log 2>&1 && fail "T=2 on a GPU ran in one process"
grep -q "pipeline.tensor_parallel = 2 on GPUs runs one process per GPU (NCCL between them): launch mpirun -np 2" e4.log ||
  { cat e4.log; fail "T=2 on GPUs alone"; }
"${mpirun[@]}" -np 3 "$gpipe" train gpt64.yaml --set output.dir="$tmp/e2" --set pipeline.tensor_parallel=2 > e2.log 2>&1 &&
  fail "T=2 ran on 3 processes"
grep -q "pipeline.partitions x pipeline.tensor_parallel x pipeline.replicas is 1 x 2 x 1.*mpirun -np 2" e2.log ||
  { cat e2.log; fail "the wrong process count"; }
"${mpirun[@]}" -np 3 "$gpipe" train gpt64.yaml --set output.dir="$tmp/e3" --set pipeline.tensor_parallel=3 > e3.log 2>&1 &&
  fail "T=3 split a vocabulary of 256"
grep -q "a vocabulary of 256 tokens does not split over a tensor group of 3" e3.log || { cat e3.log; fail "T=3"; }
echo "ok: errors name the fix"

# 7. Without mpirun: the ranks as threads of this process, the same losses.
# threads NAME K T [D [--set ...]]
threads() {
  local name="$1" K="$2" T="$3" D="${4:-1}"; shift 3; [ $# -gt 0 ] && shift
  local what="pipeline.tensor_parallel = $T"
  [ "$D" -gt 1 ] && what="$what and pipeline.replicas = $D"
  timeout 300 "$gpipe" train gpt64.yaml --set output.dir="$tmp/$name" --set pipeline.partitions="$K" \
    --set pipeline.tensor_parallel="$T" --set pipeline.replicas="$D" "$@" > "$name.log" 2>&1 ||
    { cat "$name.log"; fail "run $name (threads)"; }
  grep -q "$what: $((K * T * D)) ranks as threads of this process" "$name.log" ||
    { cat "$name.log"; fail "$name: not run as threads"; }
}
threads t14 1 4
same g1 t14 "GPT at K=1 x T=4 as threads of one process"
held t14.log 4
threads t22 2 2
same g1 t22 "GPT at K=2 x T=2 as threads of one process"
# The log's model line counts the whole model's parameters, as one process does.
whole_line() { grep -oE "model: [0-9]+ layers, [0-9]+ parameters" "$1" | sort -u; }
[ "$(whole_line t22.log)" = "$(whole_line g1.log)" ] && [ -n "$(whole_line g1.log)" ] ||
  { whole_line t22.log; whole_line g1.log; fail "the model line of a split run does not count the whole model"; }
# Only the first rank writes: the progress lines once each, as one process prints them.
[ "$(grep -c '^step ' t22.log)" -eq "$(grep -c '^step ' g1.log)" ] || { cat t22.log; fail "the threads print more than one rank's lines"; }
# The prediction prices the messages as in-process hand-overs.
grep -q '"source": ".*messages: inprocess' t22/report.json || fail "the threads' prediction does not price in-process messages"
# A rank that fails (the first, refusing a folder another run holds) ends every thread
# with its message, no hang.
timeout 300 "$gpipe" train gpt64.yaml --set output.dir="$tmp/t22" --set pipeline.partitions=2 \
  --set pipeline.tensor_parallel=2 --set train.seed=5 > t22again.log 2>&1
rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { cat t22again.log; fail "threads into a folder another run holds: status $rc"; }
grep -q "holds another run" t22again.log || { cat t22again.log; fail "threads into a used folder: no message naming it"; }
grep -q "<th>tensor group</th>" t22/report.html || fail "the threads' page has no tensor group column"
threads ts22 2 2 1 "${seq[@]}"
same g1 ts22 "GPT with sequence parallelism at K=2 x T=2 as threads of one process"
threads t222s 2 2 2 --set pipeline.shard_optimizer=optimizer
same g1 t222s "GPT at K=2 x T=2 x D=2 with the optimizer state sharded, as threads of one process"
# D > 1 at T = 1 still takes mpirun (a process per replica, as PyTorch's DDP).
"$gpipe" train gpt64.yaml --set output.dir="$tmp/e1" --set pipeline.replicas=2 > e1.log 2>&1 &&
  fail "D=2 at T=1 ran in one process"
grep -q "pipeline.replicas = 2 needs 2 copies of the pipeline: launch mpirun -np 2" e1.log || { cat e1.log; fail "D=2 alone"; }
echo "PASS"
