#!/usr/bin/env bash
# A slow start-up is progress (issue 36): `gpipe run` kills a launch whose heartbeat stays
# the same for 2 x pipeline.timeout_s, so building, initialising, probing, profiling and
# loading a checkpoint each count their work. The slow start-up here is real, not a mock:
# `auto` with no profile measures the model first (over 15 s here), under
# pipeline.timeout_s = 2, where a launch silent for 4 s is killed. It must finish in its
# first launch. Judged by exit status and messages, never by wall time. (At 1 s, a stage
# of the timed sweep or the steps waiting over 1 s for its neighbour on a loaded machine
# would end the launch on its own.)
set -uo pipefail
gpipe="$(readlink -f "$1")"
config="$(readlink -f "$2")"  # configs/mlp.yaml
tmp="${TEST_TMPDIR:-/tmp}/startup"
rm -rf "$tmp"; mkdir -p "$tmp"; cd "$tmp" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

timeout 600 "$gpipe" run --max-restarts 1 "$config" --set output.dir=auto --set pipeline.partitions=auto \
  --set pipeline.timeout_s=2 --set train.steps=3 > auto.log 2>&1
rc=$?
[ "$rc" -eq 0 ] || { cat auto.log; fail "the run with a profiling start-up: exit $rc"; }
grep -q "auto: no profile of this model" auto.log || { cat auto.log; fail "the start-up did not profile"; }
! grep -q "made no progress" auto.log || { cat auto.log; fail "gpipe run took the profiling start-up for a stall"; }
[ "$(grep -c 'gpipe run: launch [0-9]* of at most' auto.log)" -eq 1 ] || { cat auto.log; fail "the job was relaunched"; }
echo "ok: a start-up that profiles under pipeline.timeout_s=2 is progress: one launch, finished"
# The start-up's phases, logged once before the first step: every phase there, and the
# total the sum of the phases as printed (each rounded to 0.01 s).
python3 - auto.log <<'PY' || { cat auto.log; fail "the start-up line"; }
import re, sys
lines = [l for l in open(sys.argv[1]) if "start-up: " in l]
assert len(lines) == 1, lines
m = re.search(r"start-up: ([0-9.]+) s to the first step: (.*)$", lines[0])
total, parts = float(m.group(1)), re.findall(r"([a-z][^,]*?) ([0-9.]+) s", m.group(2))
names = [n for n, _ in parts]
for want in ["launch", "claim", "model on shapes", "auto profile+sweep", "data", "plan+memory check", "model build+init",
             "prediction+peaks", "weights to devices"]:
    assert want in names, (want, names)
s = sum(float(v) for _, v in parts)
assert abs(s - total) <= 0.01 * (len(parts) + 1), (s, total)
assert float(dict(parts)["auto profile+sweep"]) > 0, parts
PY
echo "ok: the start-up's phases are logged once, and add up to its total"
echo "PASS"
