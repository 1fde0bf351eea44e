#!/usr/bin/env bash
# Checkpoints through the trainer, with real processes and real signals:
#  1. `gpipe run` (the supervisor): the job is killed with kill -9 in the middle of a
#     save (saves slowed by GPIPE_CHECKPOINT_PAUSE_MS); the supervisor restarts it with
#     --resume, the torn save is skipped with a warning naming it, and the run finishes
#     with the uninterrupted run's losses, bit for bit;
#  2. resumed with other K and M (one process) and at K=2 x D=2 (mpirun), the losses
#     equal the uninterrupted run's to 1e-12 (float64);
#     a resumed run traces the steps after the checkpoint; resuming a finished run
#     trains nothing and leaves its reports;
#  3. SIGUSR1 saves on demand and training goes on; SIGTERM saves and stops (exit 143)
#     with the path, and the saved run resumes to the same losses;
#  4. a rank stopped with kill -STOP ends the job within pipeline.timeout_s, naming it;
#  5. a checkpoint that does not fit (another model, another optimizer, a damaged
#     shard, an unknown format version) is a clear error before training (exit 2).
# Judged by exit status, files and messages, never by wall time (outer timeouts only
# keep a broken run from hanging the suite).
set -uo pipefail
gpipe="$(readlink -f "$1")"
tmp="${TEST_TMPDIR:-/tmp}/resume"
rm -rf "$tmp"; mkdir -p "$tmp"; cd "$tmp" || exit 1
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)

for i in $(seq 300); do echo "line $i: checkpoints of the quick brown fox $((i * 37 % 101)) jump $((i * 13 % 7))"; done > text.txt
cat > lm.yaml <<YAML
model:
  input: [16]
  dtype: float64
  layers:
    - {type: embedding, vocab: 256, dim: 16}
    - repeat: 3
      layers:
        - {type: transformer_block, heads: 2, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 256, bias: false, tied: true}
  loss: {type: softmax_cross_entropy}
data: {type: text, path: $tmp/text.txt, seq_len: 16}
pipeline: {partitions: 2, micro_batches: 4}
optimizer: {type: adamw, lr: 0.003, schedule: cosine, warmup_steps: 3, clip_grad_norm: 1.0}
train: {steps: 12, batch_size: 16, log_interval: 1}
YAML

fail() { echo "FAIL: $*"; exit 1; }
# Per-step losses of report.json from `first` on, as exact JSON text.
losses() { python3 -c "
import json, sys
for s in json.load(open(sys.argv[1]))['steps']:
    if s['step'] >= int(sys.argv[2]): print(s['step'], repr(s['loss']))" "$1" "$2"; }
close() {  # report, reference report, first step: every loss within 1e-12 relative
  python3 - "$1" "$2" "$3" <<'PY' || fail "$1: losses differ from $2's beyond 1e-12"
import json, sys
a = {s["step"]: s["loss"] for s in json.load(open(sys.argv[1]))["steps"]}
b = {s["step"]: s["loss"] for s in json.load(open(sys.argv[2]))["steps"]}
first = int(sys.argv[3])
want = [k for k in b if k >= first]
assert want and all(k in a for k in want), (sorted(a), want)
for k in want:
    assert abs(a[k] - b[k]) <= 1e-12 * abs(b[k]), f"step {k}: {a[k]!r} vs {b[k]!r}"
PY
}

"$gpipe" train lm.yaml --set output.dir=ref > ref.log 2>&1 || { cat ref.log; fail "the uninterrupted run"; }
[ "$(losses ref/report.json 0 | wc -l)" -eq 12 ] || fail "12 steps in the reference report"

# 1. kill -9 during a save, under the supervisor.
GPIPE_CHECKPOINT_PAUSE_MS=150 timeout 300 "$gpipe" run --max-restarts 2 lm.yaml --set output.dir=sup \
  --set checkpoint.every=3 > sup.log 2>&1 &
sup=$!
for _ in $(seq 600); do [ -e sup/checkpoints/step-3/COMPLETE ] && break; sleep 0.1; done
[ -e sup/checkpoints/step-3/COMPLETE ] || { cat sup.log; kill $sup; fail "no checkpoint at step 3"; }
for _ in $(seq 600); do ls sup/checkpoints/step-6/ 2>/dev/null | grep -q . && break; sleep 0.05; done
child="$(pgrep -f "gpipe train lm.yaml --set output.dir=sup" | head -1)"
[ -n "$child" ] || { cat sup.log; kill $sup; fail "the supervised job is not running"; }
kill -9 "$child"
wait $sup || { cat sup.log; fail "gpipe run did not finish the job after the kill"; }
grep -q "killed by signal 9" sup.log || { cat sup.log; fail "the supervisor's restart line"; }
resumed_at="$(grep -oE 'resumed from [^ ]+step-[0-9]+ after step [0-9]+' sup.log | tail -1 | grep -oE '[0-9]+$')"
[ -n "$resumed_at" ] || { cat sup.log; fail "no resume line"; }
if [ ! -e sup/checkpoints/step-6/COMPLETE ] || [ "$resumed_at" -eq 3 ]; then
  grep -q "step-6" sup.log || { cat sup.log; fail "the torn step-6 save is not named"; }
fi
diff <(losses ref/report.json "$resumed_at") <(losses sup/report.json "$resumed_at") ||
  { cat sup.log; fail "the supervised run's losses after the restart differ from the uninterrupted run's"; }
echo "ok: kill -9 in the middle of a save; the supervisor resumed at step $resumed_at to the same losses, bit for bit"

# 2. Saved at K=2, M=4; resumed at K=3, M=6, and at K=2 x D=2 on four processes.
"$gpipe" train lm.yaml --set output.dir=save6 --set checkpoint.every=6 > save6.log 2>&1 || { cat save6.log; fail "save at 6"; }
"$gpipe" train lm.yaml --set output.dir=k3 --set pipeline.partitions=3 --set pipeline.micro_batches=6 \
  --set checkpoint.resume=save6/checkpoints/step-6 > k3.log 2>&1 || { cat k3.log; fail "resume at K=3, M=6"; }
close k3/report.json ref/report.json 7
"${mpirun[@]}" -np 4 "$gpipe" train lm.yaml --set output.dir=dp --set pipeline.replicas=2 \
  --set checkpoint.resume=save6/checkpoints/step-6 > dp.log 2>&1 || { cat dp.log; fail "resume at K=2 x D=2"; }
close dp/report.json ref/report.json 7
echo "ok: resumed at K=3, M=6 and at K=2 x D=2 (mpirun) to the uninterrupted losses within 1e-12"
# A resumed run traces the steps after its checkpoint (trace.steps not given), one
# process and mpirun alike.
for r in k3 dp; do
  python3 -c "import json, sys; t = json.load(open(sys.argv[1]))['trace']; assert t['steps'] == [8, 12], t" \
    "$r/report.json" || fail "$r: the resumed run's trace does not hold steps 8..12 (7, its first, warms up)"
done
# Resuming a finished run trains nothing and leaves its reports as they were.
before="$(md5sum save6/report.json save6/report.html)"
"$gpipe" train lm.yaml --set output.dir=save6 --resume > again.log 2>&1 || { cat again.log; fail "resume of a finished run"; }
grep -q "already reached train.steps = 12: nothing to train" again.log || { cat again.log; fail "no 'nothing to train'"; }
[ "$(md5sum save6/report.json save6/report.html)" = "$before" ] || fail "resuming a finished run rewrote its reports"
echo "ok: resumed runs trace steps 8..12; resuming a finished run trains nothing and keeps its reports"

# Async saves, in one process and on two: complete checkpoints that resume bit for bit.
"$gpipe" train lm.yaml --set output.dir=async1 --set checkpoint.every=3 --set checkpoint.keep=0 --set checkpoint.async=true \
  > async1.log 2>&1 || { cat async1.log; fail "async saves in one process"; }
"${mpirun[@]}" -np 2 "$gpipe" train lm.yaml --set output.dir=async2 --set checkpoint.every=3 \
  --set checkpoint.keep=0 --set checkpoint.async=true > async2.log 2>&1 || { cat async2.log; fail "async saves on two processes"; }
for d in async1 async2; do
  for s in 3 6 9 12; do [ -e "$d/checkpoints/step-$s/COMPLETE" ] || { cat $d.log; fail "$d: step-$s incomplete"; }; done
  "$gpipe" train lm.yaml --set output.dir="$d-resumed" --set checkpoint.resume="$d/checkpoints/step-6" \
    > "$d-resumed.log" 2>&1 || { cat "$d-resumed.log"; fail "resume from $d"; }
  diff <(losses ref/report.json 6) <(losses "$d-resumed/report.json" 6) || fail "resumed from $d: losses differ"
done
echo "ok: async saves on one and two processes resume bit for bit"

# 3. SIGUSR1 saves and goes on; SIGTERM saves and stops.
"$gpipe" train lm.yaml --set output.dir=sig --set train.steps=100000 > sig.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q '^step ' sig.log && break; sleep 0.1; done
kill -USR1 $job
for _ in $(seq 600); do ls sig/checkpoints/*/COMPLETE > /dev/null 2>&1 && break; sleep 0.1; done
ls sig/checkpoints/*/COMPLETE > /dev/null 2>&1 || { kill -9 $job; cat sig.log; fail "SIGUSR1 saved nothing"; }
kill -0 $job 2>/dev/null || { cat sig.log; fail "SIGUSR1 stopped the run"; }
kill -TERM $job
wait $job
rc=$?
[ "$rc" -eq 143 ] || { cat sig.log; fail "SIGTERM: exit $rc, want 143"; }
grep -qE "stopped by SIGTERM after step [0-9]+; saved .*sig/checkpoints/step-[0-9]+; continue it with: .* --set output.dir=sig --set train.steps=100000 --resume" sig.log ||
  { cat sig.log; fail "SIGTERM's message"; }
saved="$(grep -oE 'after step [0-9]+' sig.log | tail -1 | grep -oE '[0-9]+')"
[ -e "sig/checkpoints/step-$saved/COMPLETE" ] || fail "SIGTERM's checkpoint step-$saved"
# Resumed to a few more steps without checkpoint.every, the launch saves its last step, so
# the next --resume goes on from there (not from step $saved, training those steps again).
"$gpipe" train lm.yaml --set output.dir=sig --set train.steps=$((saved + 2)) --resume > sig2.log 2>&1 ||
  { cat sig2.log; fail "resuming the stopped run"; }
[ -e "sig/checkpoints/step-$((saved + 2))/COMPLETE" ] || { cat sig2.log; fail "a resumed launch did not save its last step"; }
"$gpipe" train lm.yaml --set output.dir=sig --set train.steps=$((saved + 3)) --resume > sig3.log 2>&1 ||
  { cat sig3.log; fail "resuming the resumed run"; }
grep -q "resumed from .*step-$((saved + 2)) after step $((saved + 2))" sig3.log ||
  { cat sig3.log; fail "the second --resume did not go on from the first one's end"; }
echo "ok: SIGUSR1 saved a checkpoint and training went on; SIGTERM saved step $saved and exited 143; resumed launches go on from each other's end"

# 4. A rank stopped with kill -STOP ends the job within the deadline.
"${mpirun[@]}" -np 2 "$gpipe" train lm.yaml --set output.dir=stuck --set train.steps=100000 \
  --set pipeline.timeout_s=3 > stuck.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q '^step ' stuck.log && break; sleep 0.1; done
victim="$(pgrep -f "gpipe train lm.yaml --set output.dir=stuck" | while read -r p; do
  [ "$(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -c '^OMPI_COMM_WORLD_RANK=1$')" -eq 1 ] && echo "$p"; done | head -1)"
[ -n "$victim" ] || { kill $job; cat stuck.log; fail "could not find rank 1"; }
kill -STOP "$victim"
wait $job
rc=$?
kill -9 "$victim" 2>/dev/null
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { cat stuck.log; fail "a stopped rank: exit $rc (124: the job hung)"; }
grep -q "pipeline.timeout_s" stuck.log || { cat stuck.log; fail "the timeout message does not name pipeline.timeout_s"; }
echo "ok: kill -STOP of rank 1 ended the job (exit $rc) naming pipeline.timeout_s"

# 5. Checkpoints that do not fit are refused before training.
refused() {  # message, then overrides
  local message="$1"; shift
  "$gpipe" train lm.yaml --set output.dir=bad "$@" > bad.log 2>&1
  local rc=$?
  if [ "$rc" -ne 2 ] || ! grep -qF -- "$message" bad.log || grep -q '^step ' bad.log; then
    cat bad.log; fail "want exit 2 and '$message' before any step (exit $rc)"
  fi
}
step6=save6/checkpoints/step-6
refused "was saved from another model: its layer 0 is embedding(256 -> 16" --set checkpoint.resume=$step6 \
  --set model.layers.0.dim=24
refused "holds the state of optimizer adamw but optimizer.type is sgd" --set checkpoint.resume=$step6 \
  --set optimizer.type=sgd
cp -r "$step6" damaged
head -c 1000 "$step6/model-00002-of-00002.safetensors" > damaged/model-00002-of-00002.safetensors
refused "model-00002-of-00002.safetensors" --set checkpoint.resume=damaged
cp -r "$step6" future
python3 -c "
import json; p = 'future/trainer_state.json'; s = json.load(open(p)); s['format_version'] = 99; json.dump(s, open(p, 'w'))"
refused "format" --set checkpoint.resume=future
refused "checkpoint 'nowhere' does not exist" --set checkpoint.resume=nowhere
echo "ok: another model's, another optimizer's, a damaged, a future and a missing checkpoint are refused"
