#!/usr/bin/env bash
# Multi-process pipelines on this machine (mpirun --oversubscribe):
#  1. `mpirun -np 2 gpipe train` (K = 2, one stage per process, MPI transport) logs the
#     same per-step losses as the single-process run of the same config;
#  2. a rank count that does not match pipeline.partitions is an error that says what would;
#  3. a rank killed mid-run ends the whole job promptly with a non-zero exit.
set -uo pipefail
gpipe="$1"
config="$2"
tmp="${TEST_TMPDIR:-/tmp}"
mpirun=(timeout 120 mpirun --allow-run-as-root --oversubscribe)
common=(--set train.steps=12 --set train.log_interval=1 --set data.eval_samples=0)

losses() { grep -E '^step ' | awk '{print $2, $4}'; }

"$gpipe" train "$config" "${common[@]}" --set output.dir="$tmp/single" > "$tmp/single.log" 2>&1 ||
  { cat "$tmp/single.log"; echo "FAIL: single-process run"; exit 1; }
"${mpirun[@]}" -np 2 "$gpipe" train "$config" "${common[@]}" --set output.dir="$tmp/multi" > "$tmp/multi.log" 2>&1 ||
  { cat "$tmp/multi.log"; echo "FAIL: mpirun -np 2 run"; exit 1; }
if ! diff <(losses < "$tmp/single.log") <(losses < "$tmp/multi.log"); then
  echo "FAIL: per-step losses differ between one process and two"; exit 1
fi
[ "$(losses < "$tmp/multi.log" | wc -l)" -eq 12 ] || { cat "$tmp/multi.log"; echo "FAIL: expected 12 step lines"; exit 1; }
echo "ok: 12 identical per-step losses with 1 and 2 processes"

"${mpirun[@]}" -np 3 "$gpipe" train "$config" "${common[@]}" --set output.dir="$tmp/bad" > "$tmp/bad.log" 2>&1
rc=$?
if [ "$rc" -eq 0 ] || ! grep -q "launched as 3 processes but pipeline.partitions is 2; run one process per stage: mpirun -np 2" "$tmp/bad.log"; then
  cat "$tmp/bad.log"; echo "FAIL: a mismatched rank count (rc=$rc)"; exit 1
fi
echo "ok: mpirun -np 3 for K=2 is refused with the fix"

# A long run; kill the process of rank 1 once it is training.
"${mpirun[@]}" -np 2 "$gpipe" train "$config" --set train.steps=100000 --set train.log_interval=1 \
  --set output.dir="$tmp/killed" > "$tmp/killed.log" 2>&1 &
job=$!
for _ in $(seq 100); do grep -q '^step ' "$tmp/killed.log" 2>/dev/null && break; sleep 0.2; done
victim="$(pgrep -f "gpipe train $config --set train.steps=100000" | while read -r p; do
  [ "$(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -c '^OMPI_COMM_WORLD_RANK=1$')" -eq 1 ] && echo "$p"; done | head -1)"
[ -n "$victim" ] || { cat "$tmp/killed.log"; echo "FAIL: could not find rank 1"; kill "$job"; exit 1; }
start=$(date +%s)
kill -9 "$victim"
wait "$job"
rc=$?
elapsed=$(( $(date +%s) - start ))
if [ "$rc" -eq 0 ] || [ "$elapsed" -gt 30 ]; then
  tail -5 "$tmp/killed.log"; echo "FAIL: killing rank 1 gave rc=$rc after ${elapsed}s"; exit 1
fi
echo "ok: killing rank 1 ended the job in ${elapsed}s with rc=$rc"
