#!/usr/bin/env bash
# A run owns its checkpoints (issue 35), with real processes, real signals and real files;
# each case is the issue's own reproduction, then what must hold instead:
#  1. resuming another run's checkpoint into a used output.dir is refused (train and run)
#     and changes nothing; into a fresh one it is a fork: a new run id, its parent in
#     run.json, trainer_state.json and report.json, the parent's losses continued exactly,
#     the parent's folder untouched, and the fork's continue command goes on with the fork;
#  2. a whole step directory of another run copied into a run's checkpoint folder is
#     never resumed (whatever its config or seed), named with its run and how to move it;
#     a foreign step that appears during a run is neither deleted by checkpoint.keep nor
#     overwritten by a save (the run stops, naming it);
#  3. every folder a run writes is locked: two jobs with one checkpoint.dir, or one whose
#     checkpoint.dir is another's, are refused; a checkpoint.dir that is (or lies in)
#     another run's folder is refused, --start-over included, and nothing of it moves;
#  4. SIGTERM during the last step (single process and gpipe run --np 2) leaves
#     report.json, report.html, trace.json and the checkpoint; the printed continue command
#     works, and writes report.json again from the checkpoint's history when it is missing;
#  5. Ctrl-C (SIGINT to the process group, as a terminal sends it) to the README's
#     multi-process command, gpipe run --np 2, while another job loads the machine, leaves
#     a complete checkpoint every time (GPIPE_CTRL_C_TRIES tries, 2 by default);
#  6. a torn save of this run (kill -9 during a save) is removed before the disk check.
# Judged by exit status, files and messages, never by wall time (outer timeouts only keep
# a broken run from hanging the suite).
set -uo pipefail
gpipe="$(readlink -f "$1")"
default_yaml="$(readlink -f "$2")"  # configs/default.yaml, the README's own
source "$(dirname "$(readlink -f "$0")")/run_test_lib.sh"  # fail, expect, write_mlp_yaml
tmp="${TEST_TMPDIR:-/tmp}/ownership"
rm -rf "$tmp"; mkdir -p "$tmp"; cd "$tmp" || exit 1
g=(timeout 300 "$gpipe")  # not for a job that is sent a signal: timeout passes it on a second time

write_mlp_yaml mlp.yaml 40 10 "checkpoint: {every: 10}"

sums() { find "$@" -type f ! -name .gpipe.lock -print0 | sort -z | xargs -0 md5sum; }
json_get() { python3 -c "import json, sys; v = json.load(open(sys.argv[1])); print(eval('v' + sys.argv[2]))" "$@"; }
run_of() { json_get "$1/run.json" "['run_id']"; }
# Every step's loss of a report.json from step $2 to $3, as exact JSON text.
losses() { python3 -c "
import json, sys
for s in json.load(open(sys.argv[1]))['steps']:
    if int(sys.argv[2]) <= s['step'] <= int(sys.argv[3]): print(s['step'], repr(s['loss']))" "$@"; }

"${g[@]}" train mlp.yaml --set output.dir=c2 > c.log 2>&1 || { cat c.log; fail "run C"; }
"${g[@]}" train mlp.yaml --set output.dir=d > d.log 2>&1 || { cat d.log; fail "run D"; }
C="$(run_of c2)"; D="$(run_of d)"
[ -n "$C" ] && [ -n "$D" ] && [ "$C" != "$D" ] || fail "runs C and D have no ids of their own ($C, $D)"
[ "$(json_get d/checkpoints/step-30/trainer_state.json "['run_id']")" = "$D" ] || fail "d's step-30 is not run D's"

# 1. Another run's checkpoint into a used folder: refused; into a fresh one: a fork.
before="$(sums c2 d)"
"${g[@]}" train mlp.yaml --set output.dir=c2 --set checkpoint.resume=d/checkpoints/step-30 --resume \
  --set train.steps=45 > mix1.log 2>&1
expect 2 mix1.log $? "checkpoint d/checkpoints/step-30 belongs to run $D, but c2 holds run $C" \
  "would mix the two runs" "--set output.dir=<a new folder>"
"${g[@]}" run mlp.yaml --set output.dir=c2 --set checkpoint.resume=d/checkpoints/step-30 --resume \
  --set train.steps=45 > mix2.log 2>&1
expect 2 mix2.log $? "belongs to run $D, but c2 holds run $C"
! grep -q "launch 1" mix2.log || fail "gpipe run launched a job that mixes two runs"
[ "$(sums c2 d)" = "$before" ] || fail "a refused resume changed run C's or run D's files"
"${g[@]}" train mlp.yaml --set output.dir=fork --set checkpoint.resume=d/checkpoints/step-30 \
  --set train.steps=45 > fork.log 2>&1
expect 0 fork.log $? "forking run $D at step 30 (d/checkpoints/step-30) into a new run"
F="$(run_of fork)"
[ -n "$F" ] && [ "$F" != "$D" ] || fail "the fork has no run id of its own ($F)"
for f in fork/run.json fork/checkpoints/step-45/trainer_state.json fork/report.json; do
  [ "$(json_get $f "['parent']['run_id']")" = "$D" ] && [ "$(json_get $f "['parent']['step']")" = 30 ] ||
    fail "$f does not name its parent, run $D at step 30"
done
[ "$(json_get fork/report.json "['run_id']")" = "$F" ] || fail "the fork's report.json is not run $F's"
[ "$(sums c2 d)" = "$before" ] || fail "the fork changed its parent's files"
# The fork goes on from its parent exactly: D continued in its own folder has its losses.
"${g[@]}" train mlp.yaml --set output.dir=d --resume --set train.steps=45 > dcont.log 2>&1 ||
  { cat dcont.log; fail "run D continued"; }
diff <(losses d/report.json 31 45) <(losses fork/report.json 31 45) > /dev/null ||
  { diff <(losses d/report.json 31 45) <(losses fork/report.json 31 45); fail "the fork's steps 31-45 are not D's"; }
# Its continue command (the same command and --resume) goes on with the fork.
"${g[@]}" train mlp.yaml --set output.dir=fork --set checkpoint.resume=d/checkpoints/step-30 \
  --set train.steps=50 --resume > fork2.log 2>&1
expect 0 fork2.log $? "resumed from fork/checkpoints/step-45 after step 45 (run $F)"
"${g[@]}" run mlp.yaml --set output.dir=forkrun --set checkpoint.resume=d/checkpoints/step-30 \
  --set train.steps=45 > forkrun.log 2>&1
expect 0 forkrun.log $? "forking run $D at step 30"
[ "$(json_get forkrun/report.json "['parent']['run_id']")" = "$D" ] || fail "gpipe run's fork does not name its parent"
# A fork's continue command goes on with the fork after its parent trained on (its
# checkpoints folder's latest moved), and after the parent was deleted.
cp -a d dlive
"${g[@]}" train mlp.yaml --set output.dir=fork3 --set checkpoint.resume=dlive/checkpoints --set train.steps=50 \
  > fork3.log 2>&1
expect 0 fork3.log $? "forking run $D at step 45"
"${g[@]}" train mlp.yaml --set output.dir=dlive --resume --set train.steps=60 > dlive.log 2>&1 || { cat dlive.log; fail "dlive"; }
"${g[@]}" train mlp.yaml --set output.dir=fork3 --set checkpoint.resume=dlive/checkpoints --set train.steps=55 \
  --resume > fork3b.log 2>&1
expect 0 fork3b.log $? "resumed from fork3/checkpoints/step-50 after step 50 (run $(run_of fork3))"
rm -rf dlive
"${g[@]}" run mlp.yaml --set output.dir=fork3 --set checkpoint.resume=dlive/checkpoints --set train.steps=58 \
  --resume > fork3c.log 2>&1
expect 0 fork3c.log $? "resumed from fork3/checkpoints/step-55 after step 55 (run $(run_of fork3))"
# gpipe run reads checkpoint.resume: auto as train does.
"${g[@]}" run mlp.yaml --set output.dir=c2 --set checkpoint.resume=auto --set train.steps=45 > c2auto.log 2>&1
expect 0 c2auto.log $? "resumed from c2/checkpoints/step-40 after step 40 (run $C)"
echo "ok: another run's checkpoint into a used folder is refused (train and run); into a fresh one it forks run $D exactly"

# 2. A whole step directory of another run in a run's folder.
"${g[@]}" train mlp.yaml --set output.dir=a > a.log 2>&1 || { cat a.log; fail "run A"; }
"${g[@]}" train mlp.yaml --set output.dir=e --set model.seed=1 > e.log 2>&1 || { cat e.log; fail "run E"; }
A="$(run_of a)"; E="$(run_of e)"
mv a/checkpoints/step-40 a-step-40
for other in d e; do
  rm -rf a/checkpoints/step-40; cp -a $other/checkpoints/step-40 a/checkpoints/
  theirs="$(run_of $other)"
  before="$(sums a)"
  "${g[@]}" train mlp.yaml --set output.dir=a --resume --set train.steps=45 > adopt-$other.log 2>&1
  expect 2 adopt-$other.log $? "a/checkpoints holds checkpoints of another run: a/checkpoints/step-40 (run $theirs)" \
    "the run this folder belongs to (run $A)" "never resumes, deletes or overwrites" "mv a/checkpoints/step-40"
  ! grep -q "allow_changes" adopt-$other.log || fail "the refusal of run $theirs's step blames a config change"
  "${g[@]}" run mlp.yaml --set output.dir=a --resume --set train.steps=45 > adopt-run-$other.log 2>&1
  expect 2 adopt-run-$other.log $? "a/checkpoints/step-40 (run $theirs)"
  "${g[@]}" train mlp.yaml --set output.dir=a --start-over > adopt-over-$other.log 2>&1
  expect 2 adopt-over-$other.log $? "a/checkpoints/step-40 (run $theirs)"
  [ "$(sums a)" = "$before" ] || fail "a refused resume changed run A's folder"
done
mv a/checkpoints/step-40 moved-40
# A folder from before run.json (no run.json, no report) whose checkpoints name two runs:
# whose it is cannot be told, so nothing is resumed.
cp -a a legacy; rm legacy/run.json legacy/report.json legacy/report.html legacy/trace.json
cp -a moved-40 legacy/checkpoints/step-10
before="$(sums legacy)"
"${g[@]}" train mlp.yaml --set output.dir=legacy --resume --set train.steps=45 > legacy.log 2>&1
expect 2 legacy.log $? "legacy/checkpoints holds checkpoints of more than one run" "run $A: " "run $E: step-10"
[ "$(sums legacy)" = "$before" ] || fail "a refused legacy resume changed the folder"
rm -r legacy/checkpoints/step-10
"${g[@]}" train mlp.yaml --set output.dir=legacy --resume --set train.steps=45 > legacy2.log 2>&1
expect 0 legacy2.log $? "resumed from legacy/checkpoints/step-30 after step 30 (run $A)"
"${g[@]}" train mlp.yaml --set output.dir=a --resume --set train.steps=45 > adopt-ok.log 2>&1
expect 0 adopt-ok.log $? "resumed from a/checkpoints/step-30 after step 30 (run $A)"
[ "$(json_get moved-40/trainer_state.json "['run_id']")" = "$E" ] || fail "the moved step changed"
# A foreign step that appears during a run: checkpoint.keep leaves it, a save does not
# overwrite it (the run stops at that step, naming it).
GPIPE_CHECKPOINT_PAUSE_MS=20 "${g[@]}" train mlp.yaml --set output.dir=live --set train.steps=100000 \
  --set checkpoint.keep=1 --set train.log_interval=1 > live.log 2>&1 &
job=$!
for _ in $(seq 600); do [ -e live/checkpoints/step-10/COMPLETE ] && break; sleep 0.05; done
# The run is held while the steps are copied in, so that step-80 is whole before the run
# gets there however slow the copies are (its saves pause 20 ms a file, not more).
trainer="$(pgrep -P $job)"  # gpipe, under timeout
[ -n "$trainer" ] && kill -STOP "$trainer" || { cat live.log; fail "no gpipe train under $job to hold"; }
[ "$(sed 's/step-//' live/checkpoints/latest 2>/dev/null || echo 0)" -lt 80 ] || { kill -CONT "$trainer"; fail "the run saved step 80 before it was held"; }
cp -a moved-40 live/checkpoints/step-5  # copied in while the run rotates around it
cp -a moved-40 staged-80 && mv staged-80 live/checkpoints/step-80
kill -CONT "$trainer"
foreign="$(sums live/checkpoints/step-5 live/checkpoints/step-80)"
wait $job
expect 2 live.log $? "cannot save step 80: live/checkpoints/step-80 holds a checkpoint of another run ($E)" \
  "never overwrites another run's checkpoint" "belongs to another run ($E); left as it is" \
  "then continue this run with: $gpipe train mlp.yaml --set output.dir=live --set train.steps=100000"
[ "$(sums live/checkpoints/step-5 live/checkpoints/step-80)" = "$foreign" ] || fail "a foreign step was changed"
[ ! -e live/checkpoints/step-60 ] && [ -e live/checkpoints/step-70/COMPLETE ] ||
  fail "checkpoint.keep=1 did not rotate the run's own checkpoints around the foreign one"
echo "ok: another run's step (same config, and another seed) is refused by name; keep and saves leave it alone"

# 3. Locks on every folder written, and checkpoint.dir in another run's folder.
"$gpipe" train mlp.yaml --set output.dir=x1 --set checkpoint.dir=shared/ck --set train.steps=100000 \
  --set train.log_interval=1 > x1.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q '^step ' x1.log && break; sleep 0.1; done
"${g[@]}" train mlp.yaml --set output.dir=x2 --set checkpoint.dir=shared/ck > lock1.log 2>&1
expect 2 lock1.log $? "shared/ck is in use by process $job" "two runs must not write to one directory"
"${g[@]}" train mlp.yaml --set output.dir=x2 --set checkpoint.dir=x1 > lock2.log 2>&1
expect 2 lock2.log $? "x1 is in use by process $job"
"${g[@]}" run mlp.yaml --set output.dir=x2 --set checkpoint.dir=shared/ck > lock3.log 2>&1
expect 2 lock3.log $? "shared/ck is in use by process $job"
kill -TERM $job; wait $job
expect 143 x1.log $? "stopped by SIGTERM"
X1="$(run_of x1)"
before="$(sums x1 shared a)"
for flags in "" "--start-over" "--resume"; do
  "${g[@]}" train mlp.yaml --set output.dir=x2 --set checkpoint.dir=shared/ck $flags > own-ck.log 2>&1
  expect 2 own-ck.log $? "checkpoint.dir shared/ck is the folder of another run ($X1)"
  "${g[@]}" train mlp.yaml --set output.dir=x3 --set checkpoint.dir=a/checkpoints $flags > in-a.log 2>&1
  expect 2 in-a.log $? "checkpoint.dir a/checkpoints lies inside $tmp/a, which is the folder of another run ($A)"
done
"${g[@]}" run mlp.yaml --set output.dir=x2 --set checkpoint.dir=shared/ck --start-over > own-ck-run.log 2>&1
expect 2 own-ck-run.log $? "checkpoint.dir shared/ck is the folder of another run ($X1)"
[ "$(sums x1 shared a)" = "$before" ] || fail "a refused run changed another run's files"
[ ! -e x2/previous ] && [ ! -e x3/previous ] || fail "--start-over moved another run's files"
"$gpipe" train mlp.yaml --set output.dir=x1 --set checkpoint.dir=shared/ck --resume --set train.steps=1000000 \
  > x1b.log 2>&1 &
job=$!
for _ in $(seq 600); do grep -q 'resumed from' x1b.log && break; sleep 0.1; done
kill -TERM $job; wait $job
expect 143 x1b.log $? "resumed from shared/ck/step-" "(run $X1)"
# An output.dir that is another run's checkpoint folder, or lies inside another run's folder.
# Refused, they leave nothing there: no folder of their own, no lock file, and the lock
# files they found name their last holder again.
before="$(sums x1 shared a)"
folders() { find "$@" -type d | sort; }
lockfiles() { find "$@" -name .gpipe.lock -print0 | sort -z | xargs -0 md5sum; }
folders_before="$(folders x1 shared a)"
locks_before="$(lockfiles x1 shared a)"
"${g[@]}" train mlp.yaml --set output.dir=shared/ck > out-ck.log 2>&1
expect 2 out-ck.log $? "output.dir shared/ck holds checkpoints itself" "of run $X1"
"${g[@]}" train mlp.yaml --set output.dir=a/checkpoints > out-ck2.log 2>&1
expect 2 out-ck2.log $? "output.dir a/checkpoints holds checkpoints itself" "of run $A"
"${g[@]}" train mlp.yaml --set output.dir=a/sub > out-in.log 2>&1
expect 2 out-in.log $? "output.dir a/sub lies inside $tmp/a, the folder of run $A"
[ "$(sums x1 shared a)" = "$before" ] || fail "a refused run changed another run's files"
[ "$(folders x1 shared a)" = "$folders_before" ] || fail "a refused run left folders in another run's: $(folders x1 shared a)"
[ "$(lockfiles x1 shared a)" = "$locks_before" ] || fail "a refused run left lock files, or its name in one, in another run's"
# One folder by two names (a symbolic link) is one folder, locked once.
mkdir real; ln -s real alias
"${g[@]}" train mlp.yaml --set output.dir=real --set checkpoint.dir=alias --set train.steps=10 > alias.log 2>&1
expect 0 alias.log $? "saved checkpoint alias/step-10"
# gpipe run --start-over moves the folder's own run aside, as train --start-over does.
"${g[@]}" run mlp.yaml --set output.dir=x1 --set checkpoint.dir=shared/ck --start-over --set train.steps=10 \
  > x1over.log 2>&1
expect 0 x1over.log $? "was moved to x1/previous/$X1"
[ -e "x1/previous/$X1/checkpoints/run.json" ] && [ "$(run_of x1)" != "$X1" ] || fail "gpipe run --start-over"
echo "ok: one checkpoint.dir for two jobs, and another run's checkpoint folder, are refused; nothing moved"

# 4. A stop signal in the last step. Steps long enough (about a tenth of a second or more
# here) that the signal lands in step 4, not after it; either way the run's files must be whole.
cat > slow.yaml <<YAML
model:
  input: [512]
  layers:
    - {type: linear, out: 2048}
    - {type: relu}
    - {type: linear, out: 2048}
    - {type: relu}
    - {type: linear, out: 4}
  loss: {type: softmax_cross_entropy}
data: {classes: 4, eval_samples: 64}
pipeline: {partitions: 2, micro_batches: 2}
optimizer: {type: adam, lr: 0.001}
train: {steps: 4, batch_size: 1024, log_interval: 1}
YAML
sed 's/^train:/checkpoint: {async: true}\ntrain:/' slow.yaml > slow-async.yaml
last_step() {  # name, config, launcher...: SIGTERM once step 3 of 4 is printed
  local name="$1" config="$2"; shift 2
  local try rc
  # The signal is sent when step 3's line appears, meant for step 4. A process that checks
  # for a stop between that line and step 4 (under mpirun, whichever rank reaches the ranks'
  # agreement after step 3 last) stops after step 3 instead, as it should: that try missed
  # the last step, and is run again.
  for try in 1 2 3; do
    rm -rf "$name" "$name.log"
    "$@" "$config" --set output.dir="$name" > "$name.log" 2>&1 &
    local job=$!
    for _ in $(seq 6000); do grep -q '^step *3/4' "$name.log" && break; sleep 0.01; done
    kill -TERM $job; wait $job
    rc=$?
    grep -qE 'stopped by [^;]* after step 3;' "$name.log" || break
    echo "note: $name try $try: the stop landed after step 3, before the last step; again"
  done
  expect 143 "$name.log" $rc "Report: $name/report.json"
  for f in report.json report.html trace.json checkpoints/step-4/COMPLETE; do
    [ -e "$name/$f" ] || { cat "$name.log"; fail "$name: a stop in the last step left no $f"; }
  done
  python3 -c "import json, sys; assert [s['step'] for s in json.load(open(sys.argv[1]))['steps']] == [1, 2, 3, 4]" \
    "$name/report.json" || fail "$name/report.json does not hold steps 1-4"
}
last_step last slow.yaml "$gpipe" train
grep -qF "stopped by SIGTERM at the end of the run: its 4 steps are done; saved last/checkpoints/step-4" last.log ||
  { cat last.log; fail "the stop's message does not say the run is complete"; }
again="$(grep -oE 'continue it with: .*' last.log | sed 's/^continue it with: //; s/ (it trains on .*//')"
[ -n "$again" ] || { cat last.log; fail "no continue command after a stop in the last step"; }
eval "$again" > again.log 2>&1
expect 0 again.log $? "already reached train.steps = 4: nothing to train" "last is left as it was"
cp last/report.json last-report.json
rm last/report.json
eval "$again" > again2.log 2>&1
expect 0 again2.log $? "writing its missing report from the checkpoint's history" "Report: last/report.json"
diff <(losses last-report.json 1 4) <(losses last/report.json 1 4) > /dev/null ||
  fail "the report written again has other losses than the run's"
[ -n "$(json_get last/report.json "['regenerated']")" ] || fail "the report written again does not say so"
grep -q 'id="no-timings"' last/report.html && ! grep -q "step time (measured)" last/report.html ||
  fail "the page written again shows times it never measured"
json_sum="$(md5sum < last/report.json)"
rm last/report.html
eval "$again" > again3.log 2>&1
expect 0 again3.log $? "writing its missing report from the checkpoint's history" "Page: last/report.html"
[ -e last/report.html ] && [ "$(md5sum < last/report.json)" = "$json_sum" ] ||
  fail "a missing report.html was not written again, or report.json was rewritten with it"
last_step lastasync slow-async.yaml "$gpipe" train
grep -q "async: true" <(json_get lastasync/report.json "['effective_config']") ||
  fail "the async case did not run with checkpoint.async"
last_step lastmp slow.yaml "$gpipe" run --np 2
grep -qF "gpipe on rank 0: stopped by SIGUSR2 (a stop request) at the end of the run" lastmp.log ||
  { cat lastmp.log; fail "rank 0 did not stop at the end of the run"; }
echo "ok: SIGTERM in the last step (train, train with async saves, run --np 2) leaves the reports and the checkpoint; the continue command works"

# 5. Ctrl-C to the README's multi-process command while another job loads the machine.
"${g[@]}" train mlp.yaml --set output.dir=load --set train.steps=100000000 > load.log 2>&1 &
load=$!
tries="${GPIPE_CTRL_C_TRIES:-2}"
for try in $(seq "$tries"); do
  rm -rf cc cc.log
  # setsid: gpipe run leads a process group of its own, as a terminal's foreground job does
  # (no `timeout` in between: it would pass the group's SIGINT on a second time).
  setsid "$gpipe" run --np 2 "$default_yaml" --set output.dir=cc --set train.log_interval=1 > cc.log 2>&1 < /dev/null &
  job=$!
  for _ in $(seq 1200); do grep -q '^step  *4/' cc.log && break; sleep 0.1; done
  kill -INT -- -"$job"; wait $job
  expect 130 cc.log $? "gpipe run: stopped by signal 2 (Interrupt)" "Continue it with: "
  step0="$(grep -oE 'rank 0: stopped .* after step [0-9]+' cc.log | grep -oE '[0-9]+$')"
  [ -n "$step0" ] && [ -e "cc/checkpoints/step-$step0/COMPLETE" ] ||
    { cat cc.log; fail "Ctrl-C try $try: no complete checkpoint"; }
  grep -q "rank 1: stopped .* after step $step0;" cc.log || { cat cc.log; fail "Ctrl-C try $try: rank 1 stopped elsewhere"; }
  echo "ok: Ctrl-C try $try of $tries to gpipe run --np 2 under load: both ranks saved step $step0"
done
kill -TERM $load; wait $load

# 6. A torn save of this run is removed before the disk check.
GPIPE_CHECKPOINT_PAUSE_MS=200 "$gpipe" train mlp.yaml --set output.dir=torn --set train.steps=100000 \
  > torn.log 2>&1 &
job=$!
for _ in $(seq 600); do [ -e torn/checkpoints/step-20/COMPLETE ] && break; sleep 0.05; done
for _ in $(seq 600); do [ -e torn/checkpoints/step-30 ] && break; sleep 0.01; done
kill -9 $job; wait $job 2>/dev/null
[ -d torn/checkpoints/step-30 ] && [ ! -e torn/checkpoints/step-30/COMPLETE ] || fail "no torn save to test with"
"${g[@]}" train mlp.yaml --set output.dir=torn --resume --set train.steps=25 > torn2.log 2>&1
expect 0 torn2.log $? "removed torn/checkpoints/step-30, an interrupted save of this run" \
  "resumed from torn/checkpoints/step-20"
echo "ok: a torn save of this run is removed before the disk check"
echo "PASS"
