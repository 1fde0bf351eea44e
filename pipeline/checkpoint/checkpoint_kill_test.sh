#!/usr/bin/env bash
# kill -9 of the checkpoint writer in the middle of a save, at several instants (before
# each file of a save, found through the GPIPE_CHECKPOINT_PAUSE_MS hook's log lines, and
# at two blind delays): every time, the newest complete checkpoint loads bit for bit, and
# every torn step-* directory is skipped with a warning that names it.
#   checkpoint_kill_test.sh WRITER VERIFY
set -uo pipefail
writer="$1"
verify="$2"
work="${TEST_TMPDIR:-$(mktemp -d)}/checkpoint_kill"
rm -rf "$work" && mkdir -p "$work"
export GPIPE_CHECKPOINT_PAUSE_MS=100

fail() { echo "FAIL: $*"; exit 1; }

# Waits (60 s at most; no timing is asserted) until LOG has COUNT lines matching PATTERN.
wait_for() {
  local log="$1" pattern="$2" count="$3"
  for _ in $(seq 1200); do
    [ "$(grep -c -E -- "$pattern" "$log")" -ge "$count" ] && return 0
    sleep 0.05
  done
  return 1
}

# "pattern|occurrence": kill while the writer pauses before that file of step 2's save;
# "delay:S": kill S seconds after step 1 is saved, wherever the writer is then.
instants=(
  "before writing .*/step-2/model-00001-of-00002\.safetensors|1"
  "before writing .*/step-2/optimizer-00001-of-00002\.safetensors|1"
  "before writing .*/step-2/model-00002-of-00002\.safetensors|1"
  "before writing .*/step-2/model\.safetensors\.index\.json|1"
  "before writing .*/step-2/trainer_state\.json|1"
  "before writing .*/step-2/COMPLETE|1"
  "before writing .*/latest |2"
  "delay:0.05"
  "delay:0.37"
)

torn_seen=0
i=0
for instant in "${instants[@]}"; do
  i=$((i + 1))
  dir="$work/run$i"
  log="$work/run$i.log"
  : > "$log"
  "$writer" "$dir" > "$log" 2>&1 &
  pid=$!
  if [[ "$instant" == delay:* ]]; then
    wait_for "$log" "^saved step 1$" 1 || { cat "$log"; fail "run $i: step 1 was never saved"; }
    sleep "${instant#delay:}"
  else
    wait_for "$log" "${instant%|*}" "${instant##*|}" || { cat "$log"; fail "run $i: never reached '$instant'"; }
  fi
  kill -9 "$pid"
  wait "$pid" 2>/dev/null
  saved=$(grep -c '^saved step' "$log")

  out="$("$verify" "$dir" 2>&1)" || { echo "$out"; fail "run $i ($instant): no loadable checkpoint after the kill"; }
  step=$(sed -n 's/^verified step \([0-9]*\)$/\1/p' <<< "$out")
  [ -n "$step" ] && [ "$step" -ge "$saved" ] && [ "$step" -ge 1 ] ||
    { echo "$out"; fail "run $i ($instant): loaded step '$step', but step $saved had been saved"; }
  for d in "$dir"/step-*; do
    [ -f "$d/COMPLETE" ] && continue
    torn_seen=$((torn_seen + 1))
    grep -qF "$d is incomplete" <<< "$out" || { echo "$out"; fail "run $i: the torn $d was not named in a warning"; }
  done
  echo "run $i ($instant): killed after $saved saves; verified step $step; $(ls -d "$dir"/step-* | wc -l) step directories"
  [ "$i" -eq 1 ] && echo "$out"
done

# The kills must have hit saves in the middle, or this test proved nothing.
[ "$torn_seen" -ge 3 ] || fail "only $torn_seen of ${#instants[@]} kills left a torn save"

# A later run saves over the torn state: its saves complete, and the torn ones are gone.
GPIPE_CHECKPOINT_PAUSE_MS=0 "$writer" "$work/run1" 3 > "$work/again.log" 2>&1 || { cat "$work/again.log"; fail "saving again"; }
out="$("$verify" "$work/run1" 2>&1)" || { echo "$out"; fail "verify after saving again"; }
grep -q "^verified step 3$" <<< "$out" || { echo "$out"; fail "expected step 3 after saving again"; }
! grep -q "incomplete" <<< "$out" || { echo "$out"; fail "torn directories left after a complete save"; }
echo "checkpoint_kill_test: ok ($torn_seen torn saves skipped)"
