#!/usr/bin/env bash
# Runs every benchmark of bench/ and prints a summary (figures: bench/RESULTS.md).
# Called by `./gpipe bench [args]`.
#
#   bench/run.sh [--repeats N] [--quick] [--no-torch] [--wait-idle SECONDS] [--out FILE]
#
#   --repeats N       run every case N times (default 4); the summary takes medians
#   --quick           one repeat, fewer steps: a smoke test, not a measurement
#   --no-torch        skip the PyTorch comparison
#   --wait-idle S     wait up to S seconds for the 1-minute load average to fall below 0.5
#   --out FILE        keep the raw JSON lines there (default: a temporary file)
#
# Cases (a CPU device is one core: one BLAS thread per stage, stage threads pinned):
#   speed_k{1,2}_<mode>   MLP 16 x Linear(1024)+ReLU + Linear(1024->10), batch 256, M=8,
#                         checkpoint never / except_last / always
#   bubble_m{4,16}        the same at K=2, checkpoint never, M=4 and M=16
#   bubble_lead_relu_m{8,16}  diagnostic: a ReLU before the first Linear, so that the
#                         two halves of the model do equal work (see RESULTS.md)
#   pair_k1_core{0,1}     diagnostic: two K=1 runs at once, one per core: how much the
#                         cores slow each other down with no pipeline involved
#   overhead_k{1,2}_m{8,16}  16 x Linear(64)+ReLU + Linear(64->10), batch 64, against
#                         the direct single-thread baseline (--direct)
#   torch_*               PyTorch's Pipe on the same MLP (bench/torch_gpipe.py)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

repeats=4 quick=0 torch=1 wait_idle=0 out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) repeats="$2"; shift 2 ;;
    --quick) quick=1; repeats=1; shift ;;
    --no-torch) torch=0; shift ;;
    --wait-idle) wait_idle="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "bench/run.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || out="$(mktemp /tmp/gpipe-bench.XXXXXX.jsonl)"
: > "$out"

log() { printf 'bench: %s\n' "$*" >&2; }

# Debian's python3-torch lives in /usr/bin/python3; a pyenv python3 may lack it.
PY=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c "import torch" >/dev/null 2>&1; then PY="$p"; break; fi
done
if [ "$torch" = 1 ] && [ -z "$PY" ]; then
  log "no python3 with torch found (apt-get install python3-torch); skipping the PyTorch comparison"
  torch=0
fi
SUMMARY_PY="${PY:-python3}"

log "building //bench:all"
bazel build -c opt //bench:all >&2
# The bazel-bin link follows whichever configuration built last (another build with
# --config=cuda moves it), so take the binary from this configuration's output tree
# and run a private copy.
bindir="$(mktemp -d /tmp/gpipe-bench-bin.XXXXXX)"
cp "$(bazel info -c opt bazel-bin 2>/dev/null)/bench/pipeline_bench" "$bindir/"
BIN="$bindir/pipeline_bench"

load1() { cut -d' ' -f1 /proc/loadavg; }
if [ "$wait_idle" -gt 0 ]; then
  for ((s = 0; s < wait_idle; s += 10)); do
    awk -v l="$(load1)" 'BEGIN { exit !(l < 0.5) }' && break
    log "load average $(load1); waiting for the machine to go idle"
    sleep 10
  done
fi
log "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); load $(load1)"
awk -v l="$(load1)" 'BEGIN { exit !(l > 0.5) }' &&
  log "WARNING: the machine is busy (load $(load1)); timings will be disturbed"

if [ "$quick" = 1 ]; then big="--steps 3 --warmup 1" small="--steps 30 --warmup 5"
else big="--steps 10 --warmup 2" small="--steps 200 --warmup 20"; fi
MLP="--width 1024 --depth 16 --batch 256 --classes 10"
TINY="--width 64 --depth 16 --batch 64 --classes 10"

# Runs one case and appends its JSON line, tagged with the case and repeat; the
# programs' stderr goes to $errlog. A failed case is reported and counted. A run
# during which other programs used more than 0.1 core (its "foreign_cores", e.g.
# someone's build) is run again, up to twice; the pair_* cases run two at once and
# are exempt.
errlog="$out.stderr"
: > "$errlog"
failures=0
field() { printf '%s' "$1" | sed -E -n "s/.*\"$2\": ?([0-9.eE+-]+).*/\1/p"; }
run_case() {
  local tag="$1" rep="$2"; shift 2
  local line foreign attempt
  for attempt in 1 2 3; do
    line="$("$@" 2>>"$errlog" | tail -n 1)" || true
    foreign="$(field "$line" foreign_cores)"
    case "$tag" in pair_*) break ;; esac
    awk -v f="${foreign:-0}" 'BEGIN { exit !(f > 0.1) }' || break
    [ "$attempt" -lt 3 ] && log "$tag #$rep: other programs used $foreign cores meanwhile; running it again"
  done
  case "$line" in
    "{"*) printf '%s\n' "{\"case\":\"$tag\",\"repeat\":$rep,${line#\{}" >> "$out"
          log "$tag #$rep: $(field "$line" step_ms) ms/step (other programs: ${foreign:-?} cores)" ;;
    *) log "$tag #$rep: FAILED ($*); last lines of $errlog:"; tail -n 5 "$errlog" >&2
       failures=$((failures + 1)) ;;
  esac
}

start=$SECONDS
for ((r = 1; r <= repeats; r++)); do
  for mode in never except_last always; do
    run_case "speed_k1_$mode" "$r" "$BIN" --k 1 --m 8 --checkpoint "$mode" $MLP $big
    run_case "speed_k2_$mode" "$r" "$BIN" --k 2 --m 8 --checkpoint "$mode" $MLP $big
  done
  run_case pair_k1_core1 "$r" "$BIN" --k 1 --m 8 --checkpoint never --core 1 $MLP $big &
  run_case pair_k1_core0 "$r" "$BIN" --k 1 --m 8 --checkpoint never --core 0 $MLP $big
  wait
  grep -q "\"case\":\"pair_k1_core1\",\"repeat\":$r," "$out" || failures=$((failures + 1))
  run_case speed_k1_m1 "$r" "$BIN" --k 1 --m 1 --checkpoint never $MLP $big
  for m in 4 16; do
    run_case "bubble_m$m" "$r" "$BIN" --k 2 --m "$m" --checkpoint never $MLP $big
  done
  for m in 8 16; do
    run_case "bubble_lead_relu_m$m" "$r" "$BIN" --k 2 --m "$m" --checkpoint never --lead-relu $MLP $big
  done
  for k in 1 2; do
    for m in 8 16; do
      run_case "overhead_k${k}_m$m" "$r" "$BIN" --k "$k" --m "$m" --checkpoint never $TINY $small --direct
    done
  done
  if [ "$torch" = 1 ]; then
    T="$PY bench/torch_gpipe.py"
    run_case torch_k1 "$r" $T --k 1 $MLP $big --threads 1
    run_case torch_k1_pipe "$r" $T --k 1 --k1-pipe --m 8 --checkpoint never $MLP $big --threads 1
    for mode in never except_last always; do
      run_case "torch_k2_$mode" "$r" $T --k 2 --m 8 --checkpoint "$mode" $MLP $big --threads 1
    done
    run_case torch_k1_2threads "$r" $T --k 1 $MLP $big --threads 2
  fi
done
log "done in $((SECONDS - start)) s; raw results: $out"
rm -rf "$bindir"

echo
echo "gpipe benchmarks, $(date -u +%Y-%m-%d), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
"$SUMMARY_PY" bench/summarize.py "$out"
if [ "$failures" -gt 0 ]; then
  log "$failures case(s) failed; see $errlog"
  exit 1
fi
