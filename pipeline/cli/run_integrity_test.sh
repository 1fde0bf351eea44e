#!/usr/bin/env bash
# A run that cannot be mixed up, corrupted or lost (issue 18), with real processes, real
# signals and real files:
#  1. run mixing: a fresh `train` or `run` in a directory that holds another run is
#     refused before it trains and leaves that run as it was; --start-over moves it to
#     previous/; --resume refuses a config that makes another run unless allowed; the
#     hint printed after Ctrl-C, pasted as it is, continues the same run;
#  2. a flipped data byte and a shard copied in from another step: named, skipped, and
#     the run resumes from the newest intact checkpoint to the uninterrupted losses;
#  3. two runs on one directory: the second is refused at once, naming the first's pid;
#  4. SIGINT and SIGTERM to `gpipe run --np 2` (three times): exit 128+signal, every
#     rank saved the same step, COMPLETE; plain mpirun with a longer
#     odls_base_sigkill_timeout, and kill -USR2 to plain mpirun, save too;
#  5. a damaged newest checkpoint under the supervisor: it falls back to the older one
#     and finishes with the uninterrupted losses;
#  6. kill -STOP of the single-process child of `gpipe run`: killed and restarted;
#  7. a tmpfs too small for a checkpoint, one with room for one checkpoint but not the
#     next beside it, one that fills up mid-run, a read-only one:
#     exit 2 with the path and the size, no restart;
#  8. a resumed run's report.json holds the whole run, each launch marked.
# Judged by exit status, files and messages, never by wall time (outer timeouts only
# keep a broken run from hanging the suite).
set -uo pipefail
gpipe="$(readlink -f "$1")"
source "$(dirname "$(readlink -f "$0")")/run_test_lib.sh"  # fail, expect, write_mlp_yaml
tmp="${TEST_TMPDIR:-/tmp}/integrity"
rm -rf "$tmp"; mkdir -p "$tmp"; cd "$tmp" || exit 1
mpirun=(timeout 300 mpirun --allow-run-as-root --oversubscribe)

write_mlp_yaml mlp.yaml 12 1

# Every step's loss of report.json from `first` on, as exact JSON text.
losses() { python3 -c "
import json, sys
for s in json.load(open(sys.argv[1]))['steps']:
    if s['step'] >= int(sys.argv[2]): print(s['step'], repr(s['loss']))" "$1" "$2"; }
same_losses() {  # report, first step, log to show on failure
  diff <(losses ref/report.json "$2") <(losses "$1" "$2") > /dev/null ||
    { cat "$3"; diff <(losses ref/report.json "$2") <(losses "$1" "$2"); fail "$1: losses from step $2 differ from the uninterrupted run's"; }
}
flip() {  # file, offsets from the end: flips those bytes of a shard's tensor data
  python3 - "$@" <<'PY'
import sys
p = sys.argv[1]; b = bytearray(open(p, "rb").read())
for o in sys.argv[2:]: b[len(b) - int(o)] ^= 0xFF
open(p, "wb").write(b)
PY
}
resumed_from() { grep -oE 'resumed from [^ ]+step-[0-9]+ after step [0-9]+' "$1" | tail -1 | grep -oE '[0-9]+$'; }

"$gpipe" train mlp.yaml --set output.dir=ref > ref.log 2>&1 || { cat ref.log; fail "the uninterrupted run"; }

# 1. Run mixing.
"$gpipe" train mlp.yaml --set output.dir=old --set checkpoint.every=4 > old.log 2>&1 || { cat old.log; fail "old run"; }
sums() { find old -type f ! -name .gpipe.lock -print0 | sort -z | xargs -0 md5sum; }
before="$(sums)"
"$gpipe" train mlp.yaml --set output.dir=old > mix1.log 2>&1
expect 2 mix1.log $? "old holds another run" "--resume" "--set output.dir=" "--start-over"
"$gpipe" run mlp.yaml --set output.dir=old > mix2.log 2>&1
expect 2 mix2.log $? "old holds another run"
! grep -q "launch 1" mix2.log || fail "gpipe run launched a job into another run's directory"
! grep -q '^step ' mix1.log mix2.log || fail "a refused run trained"
[ "$(sums)" = "$before" ] || fail "a refused run changed the earlier run's files"
old_id="$(python3 -c "import json; print(json.load(open('old/checkpoints/step-12/trainer_state.json'))['run_id'])")"
"$gpipe" train mlp.yaml --set output.dir=old --start-over > over.log 2>&1
expect 0 over.log $? "moved to old/previous/$old_id"
[ -e "old/previous/$old_id/checkpoints/step-12/COMPLETE" ] && [ -e "old/previous/$old_id/report.json" ] ||
  fail "--start-over did not keep the earlier run under previous/"
new_id="$(python3 -c "import json; print(json.load(open('old/report.json'))['run_id'])")"
[ -n "$new_id" ] && [ "$new_id" != "$old_id" ] || fail "the new run has no id of its own ($new_id vs $old_id)"
# --resume with a config that makes another run.
"$gpipe" train mlp.yaml --set output.dir=old/previous/$old_id --set train.steps=14 --set optimizer.lr=0.02 --resume \
  > changed.log 2>&1
expect 2 changed.log $? "optimizer.lr: 0.01 -> 0.02" "checkpoint.allow_changes=[optimizer.lr]"
"$gpipe" train mlp.yaml --set output.dir=old/previous/$old_id --set train.steps=14 --set optimizer.lr=0.02 --resume \
  --set checkpoint.allow_changes=[optimizer.lr] > allowed.log 2>&1
expect 0 allowed.log $? "resumed from old/previous/$old_id/checkpoints/step-12 after step 12 (run $old_id)"
# A bfloat16 run's checkpoint holds float32 master weights and names its precision: a
# float32 run resumes it once model.dtype may change, and a bfloat16 run resumes that.
"$gpipe" train mlp.yaml --set output.dir=b16 --set model.dtype=bf16 --set checkpoint.every=4 > b16.log 2>&1 ||
  { cat b16.log; fail "bf16 run"; }
python3 - b16/checkpoints/step-12 <<'PY' || fail "the bf16 checkpoint is not float32 masters named bfloat16"
import json, struct, sys, glob
d = sys.argv[1]
assert json.load(open(d + "/trainer_state.json"))["precision"] == "bfloat16"
for f in glob.glob(d + "/*.safetensors"):
    raw = open(f, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]
    for k, v in json.loads(raw[8:8 + n]).items():
        assert k == "__metadata__" or v["dtype"] in ("F32", "F64"), (f, k, v["dtype"])
PY
"$gpipe" train mlp.yaml --set output.dir=b16 --set model.dtype=float32 --set train.steps=14 --resume > b16f.log 2>&1
expect 2 b16f.log $? 'model.dtype: "bfloat16" -> "float32"' "checkpoint.allow_changes=[model.dtype]"
"$gpipe" train mlp.yaml --set output.dir=b16 --set model.dtype=float32 --set train.steps=14 --resume \
  --set checkpoint.allow_changes=[model.dtype] --set checkpoint.every=2 > b16f2.log 2>&1
expect 0 b16f2.log $? "after step 12"
"$gpipe" train mlp.yaml --set output.dir=b16 --set model.dtype=bf16 --set train.steps=16 --resume \
  --set checkpoint.allow_changes=[model.dtype] --set checkpoint.every=2 > b16b.log 2>&1
expect 0 b16b.log $? "after step 14"
# ... and in fp16, whose loss scale then starts from the config's (the checkpoint has none).
"$gpipe" train mlp.yaml --set output.dir=b16 --set model.dtype=fp16 --set train.steps=18 --resume \
  --set checkpoint.allow_changes=[model.dtype] > b16h.log 2>&1
expect 0 b16h.log $? "after step 16" "Loss scaling (fp16): "
# fp16's loss scale goes on where it was: a scale too large for float16 comes down over the
# first steps (each skipped), and a resume starts from the saved scale, not from the config's.
"$gpipe" train mlp.yaml --set output.dir=f16 --set model.dtype=fp16 --set optimizer.loss_scale=16777216 \
  --set checkpoint.every=4 > f16.log 2>&1 || { cat f16.log; fail "fp16 run"; }
expect 0 f16.log 0 "step 1: the gradients overflowed float16 at loss scale 16777216; the step was skipped" \
  "Loss scaling (fp16): "
saved_scale="$(python3 -c "import json; print(json.load(open('f16/checkpoints/step-12/trainer_state.json'))['loss_scale']['scale'])")"
python3 -c "import sys; s = float(sys.argv[1]); assert 1 <= s < 16777216, s" "$saved_scale" ||
  fail "the fp16 checkpoint's loss scale is $saved_scale, not lowered"
python3 - f16/report.json <<'PY' || fail "report.json's loss_scaling disagrees with the log"
import json, sys
ls = json.load(open(sys.argv[1]))["loss_scaling"]
log = open("f16.log").read()
assert ls["skipped_steps"] == [n for n in range(1, 13) if f"step {n}: the gradients overflowed" in log], ls
PY
"$gpipe" train mlp.yaml --set output.dir=f16 --set model.dtype=fp16 --set optimizer.loss_scale=16777216 \
  --set train.steps=14 --resume > f16r.log 2>&1
expect 0 f16r.log $? "after step 12"
! grep -q "overflowed float16 at loss scale 16777216" f16r.log || fail "the resumed run started from the config's scale"
# A run that saved no checkpoint leaves reports only: --resume would start from step 0
# over them, and is refused; the fresh-run message does not offer --resume.
"$gpipe" train mlp.yaml --set output.dir=nockpt --set train.steps=3 > nockpt.log 2>&1 || { cat nockpt.log; fail "nockpt"; }
before="$(md5sum nockpt/report.json)"
"$gpipe" train mlp.yaml --set output.dir=nockpt --resume > nockpt2.log 2>&1
expect 2 nockpt2.log $? "nockpt holds another run's reports (nockpt/report.json) but no checkpoint to resume from" \
  "--start-over"
"$gpipe" train mlp.yaml --set output.dir=nockpt > nockpt3.log 2>&1
expect 2 nockpt3.log $? "nockpt holds another run"
! grep -q -- "--resume" nockpt3.log || { cat nockpt3.log; fail "offered --resume to a run without checkpoints"; }
[ "$(md5sum nockpt/report.json)" = "$before" ] || fail "a refused resume changed the earlier run's report"
# A launch that gpipe run gave another run's id does not resume this run's checkpoints.
"$gpipe" train mlp.yaml --set output.dir=old/previous/$old_id --set train.steps=16 --resume --run-id not-this-run \
  > foreign.log 2>&1
expect 2 foreign.log $? "belongs to run $old_id, not to this run not-this-run"
echo "ok: run mixing refused (train and run), --start-over moves the earlier run aside, changed configs and other runs refused"
# The hint after Ctrl-C, pasted as it is, continues the same run.
"$gpipe" train mlp.yaml --set output.dir=hint --set train.steps=100000 --set train.log_interval=1 > hint.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q '^step ' hint.log && break; sleep 0.1; done
kill -INT $job; wait $job
expect 130 hint.log $? "continue it with: "
again="$(grep -oE 'continue it with: .*' hint.log | sed 's/^continue it with: //')"
case "$again" in *"--set output.dir=hint"*"--resume") ;; *) fail "the hint '$again' drops the run's settings";; esac
stopped="$(grep -oE 'after step [0-9]+' hint.log | grep -oE '[0-9]+')"
eval "exec $again" > hint2.log 2>&1 &  # exec: the signal goes to gpipe, not to a subshell
job=$!
for _ in $(seq 600); do grep -q '^step ' hint2.log && break; sleep 0.1; done
kill -INT $job; wait $job
expect 130 hint2.log $? "resumed from hint/checkpoints/step-$stopped after step $stopped"
echo "ok: the hint after Ctrl-C, pasted, resumed the same run at step $stopped"

# 2. Damaged and mixed-up checkpoints are named and skipped.
"$gpipe" train mlp.yaml --set output.dir=dmg --set checkpoint.every=4 --set checkpoint.keep=0 --set train.steps=8 \
  > dmg.log 2>&1 || { cat dmg.log; fail "dmg run"; }
cp -r dmg swap
flip dmg/checkpoints/step-8/model-00002-of-00002.safetensors 8 100 200
"$gpipe" train mlp.yaml --set output.dir=dmg --resume > dmg2.log 2>&1
expect 0 dmg2.log $? "checkpoint dmg/checkpoints/step-8 cannot be used" "does not match its checksum" \
  "resuming from dmg/checkpoints/step-4, the newest intact checkpoint"
same_losses dmg/report.json 4 dmg2.log
cp swap/checkpoints/step-4/optimizer-00001-of-00002.safetensors swap/checkpoints/step-8/
"$gpipe" train mlp.yaml --set output.dir=swap --resume > swap2.log 2>&1
expect 0 swap2.log $? "optimizer-00001-of-00002.safetensors' says it holds step 4 but its checkpoint is of step 8" \
  "resuming from swap/checkpoints/step-4"
same_losses swap/report.json 4 swap2.log
# The resumed launch saved its last step (checkpoint.every is 0 there: a launch that
# resumed saves its end). Nothing intact: the run stops and names what it found.
[ -e dmg/checkpoints/step-12/COMPLETE ] || { cat dmg2.log; fail "the resumed launch did not save its last step"; }
flip dmg/checkpoints/step-12/model-00002-of-00002.safetensors 8 100 200
flip dmg/checkpoints/step-4/optimizer-00001-of-00002.safetensors 8  # step-8 is damaged already
"$gpipe" train mlp.yaml --set output.dir=dmg --resume > dmg3.log 2>&1
expect 2 dmg3.log $? "no intact checkpoint to resume from (dmg/checkpoints/step-12: " "; dmg/checkpoints/step-8: " \
  "; dmg/checkpoints/step-4: "
echo "ok: a flipped byte and a shard of another step are named and skipped; the resumed losses are the uninterrupted run's"

# 3. Two runs on one directory.
"$gpipe" train mlp.yaml --set output.dir=busy --set train.steps=100000 > busy1.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q '^step ' busy1.log && break; sleep 0.1; done
"$gpipe" train mlp.yaml --set output.dir=busy --set train.steps=3 > busy2.log 2>&1
expect 2 busy2.log $? "busy is in use by process $job (run " "two runs must not write to one directory"
"$gpipe" run mlp.yaml --set output.dir=busy --resume > busy3.log 2>&1
expect 2 busy3.log $? "busy is in use by process $job"
kill -TERM $job; wait $job
expect 143 busy1.log $? "stopped by SIGTERM"
# The lock of a dead process is taken over.
"$gpipe" train mlp.yaml --set output.dir=busy --set train.steps=100000 --resume > busy4.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q '^step ' busy4.log && break; sleep 0.1; done
kill -9 $job; wait $job 2>/dev/null
"$gpipe" train mlp.yaml --set output.dir=busy --resume > busy5.log 2>&1
expect 0 busy5.log $? "resumed from busy/checkpoints/step-"
echo "ok: a second run on a directory is refused with the first one's pid; a dead run's lock is taken over"

# 4. Signals to multi-process jobs.
for sig in INT TERM INT; do
  rm -rf sig sig.log  # the log too: the wait below must not find the last try's steps
  timeout 300 "$gpipe" run --np 2 mlp.yaml --set output.dir=sig --set train.steps=100000 > sig.log 2>&1 &
  job=$!
  for _ in $(seq 600); do grep -q '^step ' sig.log && break; sleep 0.1; done
  kill -$sig $job; wait $job
  rc=$?
  want=$([ $sig = INT ] && echo 130 || echo 143)
  expect $want sig.log $rc "gpipe on rank 0: stopped by" "gpipe on rank 1: stopped by" "Continue it with: "
  step0="$(grep -oE 'rank 0: stopped .* after step [0-9]+' sig.log | grep -oE '[0-9]+$')"
  step1="$(grep -oE 'rank 1: stopped .* after step [0-9]+' sig.log | grep -oE '[0-9]+$')"
  [ -n "$step0" ] && [ "$step0" = "$step1" ] || { cat sig.log; fail "SIG$sig: the ranks stopped after steps $step0 and $step1"; }
  [ -e "sig/checkpoints/step-$step0/COMPLETE" ] || { cat sig.log; fail "SIG$sig: step-$step0 is not complete"; }
  "$gpipe" train mlp.yaml --set output.dir=sig --set train.steps=$((step0 + 1)) --resume > sig2.log 2>&1
  expect 0 sig2.log $? "resumed from sig/checkpoints/step-$step0 after step $step0"
  echo "ok: SIG$sig to gpipe run --np 2: exit $want, both ranks saved step $step0, which resumes"
done
# Replicas of a one-stage pipeline (K = 1 x D = 2) save once, through replica 0 (both
# replicas finalized the same step before, and one failed on the other's files).
"${mpirun[@]}" -np 2 "$gpipe" train mlp.yaml --set output.dir=k1d2 --set pipeline.partitions=1 \
  --set pipeline.replicas=2 --set checkpoint.every=4 > k1d2.log 2>&1
expect 0 k1d2.log $? "saved checkpoint k1d2/checkpoints/step-12"
"${mpirun[@]}" -np 2 "$gpipe" train mlp.yaml --set output.dir=k1d2 --set pipeline.partitions=1 \
  --set pipeline.replicas=2 --set checkpoint.resume=k1d2/checkpoints/step-8 \
  > k1d2b.log 2>&1
expect 0 k1d2b.log $? "resumed from k1d2/checkpoints/step-8 after step 8"
echo "ok: K=1 x D=2 saves each checkpoint once and resumes"
# Plain mpirun: SIGTERM reaches the ranks after odls_base_sigkill_timeout seconds and
# SIGKILL after twice that (mpirun itself exits 1); SIGUSR2 is forwarded at once.
for how in TERM USR2; do
  rm -rf plain plain.log
  OMPI_MCA_odls_base_sigkill_timeout=5 "${mpirun[@]}" -np 2 "$gpipe" train mlp.yaml --set output.dir=plain \
    --set train.steps=100000 > plain.log 2>&1 &
  job=$!
  for _ in $(seq 600); do grep -q '^step ' plain.log && break; sleep 0.1; done
  launcher="$(pgrep -P $job)"  # mpirun, under timeout
  [ -n "$launcher" ] || { cat plain.log; fail "no mpirun under $job"; }
  kill -$how "$launcher"; wait $job
  step0="$(grep -oE 'rank 0: stopped .* after step [0-9]+' plain.log | grep -oE '[0-9]+$')"
  [ -n "$step0" ] && [ -e "plain/checkpoints/step-$step0/COMPLETE" ] ||
    { cat plain.log; fail "SIG$how to plain mpirun: no complete save"; }
  grep -q "rank 1: stopped .* after step $step0;" plain.log || { cat plain.log; fail "SIG$how: rank 1 stopped elsewhere"; }
  echo "ok: SIG$how to plain mpirun: both ranks saved step $step0"
done

# 5. A damaged newest checkpoint under the supervisor.
GPIPE_CHECKPOINT_PAUSE_MS=50 timeout 300 "$gpipe" run --max-restarts 2 mlp.yaml --set output.dir=sup --set checkpoint.every=3 --set checkpoint.keep=0 \
  > sup.log 2>&1 &
sup=$!
child=""
for _ in $(seq 600); do
  child="$(pgrep -f "gpipe train mlp.yaml --set output.dir=sup" | head -1)"
  # Stopped where `latest` names step 6 or later, so that an older intact checkpoint exists.
  [ -n "$child" ] && kill -STOP "$child" 2>/dev/null &&
    [ "$(sed 's/step-//' sup/checkpoints/latest 2>/dev/null || echo 0)" -ge 6 ] 2>/dev/null && break
  [ -n "$child" ] && kill -CONT "$child" 2>/dev/null
  sleep 0.05
done
newest="$(cat sup/checkpoints/latest)"
[ -e "sup/checkpoints/$newest/COMPLETE" ] && [ -e sup/checkpoints/step-3/COMPLETE ] ||
  { kill $sup; cat sup.log; fail "no checkpoint at step 6 or later"; }
flip "sup/checkpoints/$newest/model-00001-of-00002.safetensors" 8
kill -9 "$child"
wait $sup
expect 0 sup.log $? "killed by signal 9" "checkpoint sup/checkpoints/$newest cannot be used"
at="$(resumed_from sup.log)"
[ -n "$at" ] && [ "sup/checkpoints/step-$at" != "sup/checkpoints/$newest" ] || { cat sup.log; fail "resumed from the damaged $newest"; }
same_losses sup/report.json "$at" sup.log
echo "ok: the supervisor's restart skipped the damaged $newest, resumed at step $at and finished with the same losses"

# 6. A frozen single-process child.
GPIPE_CHECKPOINT_PAUSE_MS=50 timeout 300 "$gpipe" run --max-restarts 1 mlp.yaml --set output.dir=frozen --set train.steps=60 --set checkpoint.every=5 \
  --set pipeline.timeout_s=4 > frozen.log 2>&1 &
sup=$!
for _ in $(seq 600); do [ -e frozen/checkpoints/step-5/COMPLETE ] && break; sleep 0.05; done
child="$(pgrep -f "gpipe train mlp.yaml --set output.dir=frozen" | head -1)"
[ -n "$child" ] || { kill $sup; cat frozen.log; fail "the supervised job is not running"; }
kill -STOP "$child"
wait $sup
expect 0 frozen.log $? "(pid $child on " "made no progress for 8 s" "restart 1 of 1"
at="$(resumed_from frozen.log)"
[ ! -e frozen/.heartbeat ] || fail "gpipe run left its heartbeat files behind"
python3 -c "
import json, sys
steps = [s['step'] for s in json.load(open('frozen/report.json'))['steps']]
assert steps == list(range(1, 61)), steps" || fail "frozen: report.json does not hold steps 1..60"
echo "ok: kill -STOP of the child: killed after 2 x pipeline.timeout_s without progress, resumed at step $at, finished"
# Both ranks of a two-process job frozen (so no transport deadline fires): the
# supervisor kills the ranks and mpirun, and restarts the job.
GPIPE_CHECKPOINT_PAUSE_MS=50 timeout 300 "$gpipe" run --np 2 --max-restarts 1 mlp.yaml --set output.dir=frozen2 \
  --set train.steps=60 --set checkpoint.every=5 --set pipeline.timeout_s=4 > frozen2.log 2>&1 &
sup=$!
for _ in $(seq 600); do [ -e frozen2/checkpoints/step-5/COMPLETE ] && break; sleep 0.05; done
ranks="$(pgrep -f "gpipe train mlp.yaml --set output.dir=frozen2" | while read -r p; do
  [ "$(cat /proc/$p/comm 2>/dev/null)" = gpipe ] && echo "$p"; done)"  # not mpirun
[ "$(echo "$ranks" | wc -w)" -eq 2 ] || { kill $sup; cat frozen2.log; fail "the two ranks are not running: $ranks"; }
kill -STOP $ranks
wait $sup
expect 0 frozen2.log $? "made no progress for 8 s" "restart 1 of 1"
for r in $ranks; do
  case "$(ps -o stat= -p "$r" 2>/dev/null)" in ""|Z*) ;; *) fail "frozen rank $r is still there";; esac
done
echo "ok: both ranks of gpipe run --np 2 frozen: killed, restarted, finished"

# 7. Full and read-only file systems (a tmpfs of our own, in a mount namespace of our own).
if unshare -m --propagation private true 2>/dev/null; then
  mkdir -p small
  unshare -m --propagation private bash -c "
    mount -t tmpfs -o size=30k tmpfs small || exit 99
    '$gpipe' train mlp.yaml --set output.dir=small/o --set checkpoint.every=4 > tiny.log 2>&1; echo \$? > tiny.rc
    umount small; mount -t tmpfs -o size=64k tmpfs small
    '$gpipe' train mlp.yaml --set output.dir=small/one --set checkpoint.every=4 > one.log 2>&1; echo \$? > one.rc
    umount small; mount -t tmpfs -o size=120k tmpfs small
    '$gpipe' run mlp.yaml --set output.dir=small/o --set checkpoint.every=1 --set checkpoint.keep=0 > full.log 2>&1
    echo \$? > full.rc
    mount -o remount,ro small
    '$gpipe' train mlp.yaml --set output.dir=small/p > ro.log 2>&1; echo \$? > ro.rc"
  [ $? -ne 99 ] || fail "could not mount a tmpfs"
  expect 2 tiny.log "$(cat tiny.rc)" "the checkpoint folder 'small/o/checkpoints' has" "a checkpoint of this model needs"
  ! grep -q '^step ' tiny.log || fail "a run without room for a checkpoint trained"
  # Room for one checkpoint but not for two: the first save's checkpoint is kept until the
  # second is complete, so this is refused before step 1 too. A checkpoint: the float64
  # weights and Adam's two moments of the 16-32-32-4 MLP, in kB rounded up.
  one_kb="$(python3 -c "import math; print(math.ceil((16*32+32 + 32*32+32 + 32*4+4) * 8 * 3 / 1000))")"
  two_kb="$(python3 -c "import math; print(math.ceil((16*32+32 + 32*32+32 + 32*4+4) * 8 * 3 * 2 / 1000))")"
  expect 2 one.log "$(cat one.rc)" "the checkpoint folder 'small/one/checkpoints' has" \
    "a checkpoint of this model needs $one_kb kB (weights and optimizer state), and this run needs room for 2, $two_kb kB"
  ! grep -q '^step ' one.log || fail "a run with room for one checkpoint only trained"
  expect 2 full.log "$(cat full.rc)" "No space left on device" "a restart would fail the same way"
  [ "$(grep -c 'launch [0-9] of at most' full.log)" -eq 1 ] || { cat full.log; fail "a full disk was restarted"; }
  expect 2 ro.log "$(cat ro.rc)" "small/p" "Read-only file system"
  echo "ok: too small, full and read-only file systems: exit 2 naming the path and the size, no restart"
else
  echo "note: no mount namespace here (unshare -m failed): the file system cases were not run"
fi

# 8. A resumed run's report holds the whole run.
"$gpipe" train mlp.yaml --set output.dir=hist --set checkpoint.every=5 --set train.steps=5 > hist1.log 2>&1 ||
  { cat hist1.log; fail "hist1"; }
"$gpipe" train mlp.yaml --set output.dir=hist --resume > hist2.log 2>&1 || { cat hist2.log; fail "hist2"; }
python3 - <<'PY' || fail "the resumed run's report.json does not hold the whole run"
import json
r = json.load(open("hist/report.json")); ref = json.load(open("ref/report.json"))
assert [s["step"] for s in r["steps"]] == list(range(1, 13)), r["steps"]
assert [s["loss"] for s in r["steps"]] == [s["loss"] for s in ref["steps"]]
assert [s["launch"] for s in r["steps"]] == [1] * 5 + [2] * 7, r["steps"]
assert [(l["launch"], l["first_step"]) for l in r["launches"]] == [(1, 1), (2, 6)], r["launches"]
PY
echo "ok: a resumed run's report.json holds all 12 steps, in 2 launches, with the uninterrupted losses"
echo "PASS"
