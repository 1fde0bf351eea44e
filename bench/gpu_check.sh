#!/usr/bin/env bash
# The GPU check: what gets run when a GPU machine is lent. Every step asserts: the
# script exits non-zero when any check fails, after printing a table of all of them.
#
#   bench/gpu_check.sh prepare   (here, where Bazel and the Debian libraries are)
#       builds the CUDA tests and GPU benchmarks with --config=cuda and copies them,
#       with every non-CUDA shared library they load, into .gpu_carry/ (git-ignored)
#   bench/gpu_check.sh run [STEP...]   (on the GPU machine, with .gpu_carry/ carried over)
#       STEP is any of (default: all of them, in this order)
#         tests     the GPU tests plainly: CPU-vs-CUDA conformance of every op, layers,
#                   the executor on CUDA stages against CPU stages
#         sanitize  the same tests under compute-sanitizer: memcheck, racecheck, synccheck
#         lm        the default language model, 40 steps on two stages sharing cuda:0,
#                   against the same run on two CPU stages: per-step losses must agree
#         smi       nvidia-smi while runs train: every process holds memory on its own
#                   GPU only (one process with its stages on the last GPU; with mpirun
#                   and two GPUs or more, one rank per GPU)
#         nccl      with mpirun and two GPUs: the NCCL transport test (its cases, a
#                   grouped exchange both ways, and waits on a stuck peer ending the
#                   job at the deadline; runtime/nccl_transport_test.sh) and an NCCL
#                   training run against threads (pipeline/cli/nccl_train_test.sh)
#         bench     the GPU benchmarks (block_bench, pipeline_bench K = 1, 2, 4)
#       Full logs under $OUT (or /tmp/gpu_check); the table is printed last. A step that
#       the machine cannot run (one GPU, no mpirun, no compute-sanitizer) is reported as
#       skipped, never as passed.
#
# The GPU machine has the CUDA libraries but no Bazel and no Debian packages, so the
# binaries are built here; the CUDA libraries themselves are never carried.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
carry=.gpu_carry
tests=(cuda_backend_test cuda_conv_test gpu_layers_test gpu_pipeline_test)

prepare() {
  set -e
  rm -rf "$carry" && mkdir -p "$carry/lib"
  bazel build --config=cuda //kernels:cuda_backend_test //kernels:cuda_conv_test //tests:gpu_layers_test \
    //tests:gpu_pipeline_test //tests:cuda_devices //runtime:nccl_transport_check //bench:block_bench \
    //bench:pipeline_bench //pipeline:gpipe >&2
  local bin
  for bin in kernels/cuda_backend_test kernels/cuda_conv_test tests/gpu_layers_test tests/gpu_pipeline_test \
             tests/cuda_devices runtime/nccl_transport_check bench/block_bench bench/pipeline_bench pipeline/gpipe; do
    cp -L "bazel-bin/$bin" "$carry/$(basename "$bin")"
    # Every shared library it loads, except the CUDA toolkit's and the C runtime's.
    ldd "bazel-bin/$bin" | awk '/=> \// { print $3 }' | while read -r lib; do
      case "$lib" in
        */cuda*/*|*libcuda.so*|*libcudart*|*libnccl*|*libcublas*|*libcudnn*|*/libc.so*|*/libm.so*|*/ld-linux*|*/libpthread*|*/libdl.so*|*/librt.so*) ;;
        *) cp -Ln "$lib" "$carry/lib/" ;;
      esac
    done
  done
  cp bench/torch_block.py configs/default.yaml configs/mlp.yaml pipeline/cli/nccl_train_test.sh \
    runtime/nccl_transport_test.sh "$carry/"
  cp /usr/share/common-licenses/GPL-3 "$carry/GPL-3"
  # The device call carries 64 MiB at most; OpenBLAS and oneDNN alone are 76 MB, 15 packed.
  tar -C "$carry" -cJf "$carry/lib.tar.xz" lib && rm -rf "$carry/lib"
  du -sh "$carry" >&2
}

# ---- run: each check appends "name|result|detail" to $results; any FAIL fails the script.
results=""
record() { results+="$1|$2|$3"$'\n'; }
failed() { grep -q '|FAIL|' <<< "$results"; }

step_tests() {
  local t
  for t in "${tests[@]}"; do
    if timeout "${GPU_CHECK_TEST_TIMEOUT:-300}" "$carry/$t" > "$out/$t.log" 2>&1; then
      if grep -q GPIPE_TEST_SKIPPED "$out/$t.log"; then
        record "$t" FAIL "reports no GPU visible on a GPU machine ($out/$t.log)"
      else
        record "$t" pass "$(grep -m1 -E '^\[doctest\] test cases' "$out/$t.log")"
      fi
    else
      record "$t" FAIL "$out/$t.log"
    fi
  done
}

step_sanitize() {
  local sanitizer tool t
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
  if [ -z "$sanitizer" ]; then
    record sanitize skipped "no compute-sanitizer on this machine"
    return
  fi
  for tool in ${GPU_CHECK_SANITIZERS:-memcheck racecheck synccheck}; do
    for t in "${tests[@]}"; do
      local log="$out/$t.$tool.log"
      # --error-exitcode: a finding fails the run even when the test itself passes. The
      # allocator's out-of-memory case asks for more than the card has on purpose, and the
      # sanitizer counts the refused cudaMalloc as an error: it runs in `tests`, not here.
      timeout "${GPU_CHECK_SANITIZE_TIMEOUT:-900}" "$sanitizer" --tool "$tool" --error-exitcode 97 "$carry/$t" \
        --test-case-exclude='*out of memory is a UserError*' > "$log" 2>&1
      local status=$?
      if [ "$status" -eq 0 ]; then
        record "$t/$tool" pass "$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log")"
      elif [ "$status" -eq 124 ]; then
        record "$t/$tool" FAIL "did not finish in ${GPU_CHECK_SANITIZE_TIMEOUT:-900} s ($log)"
      else
        record "$t/$tool" FAIL "$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log") ($log)"
      fi
    done
  done
}

step_lm() {
  local lm=(train "$carry/default.yaml" --set "data.path=$carry/GPL-3" --set train.steps=40
            --set train.log_interval=10 --set model.layers.1.layers.0.dropout=0.0)
  timeout 300 "$carry/gpipe" "${lm[@]}" --set output.dir="$out/lm_cpu" > "$out/lm_cpu.log" 2>&1 ||
    { record lm FAIL "the CPU run failed ($out/lm_cpu.log)"; return; }
  timeout 300 "$carry/gpipe" "${lm[@]}" --set 'pipeline.devices=[cuda:0,cuda:0]' --set output.dir="$out/lm_gpu" \
    > "$out/lm_gpu.log" 2>&1 || { record lm FAIL "the GPU run failed ($out/lm_gpu.log)"; return; }
  paste <(grep -E '^step ' "$out/lm_cpu.log" | awk '{print $2, $4}') \
        <(grep -E '^step ' "$out/lm_gpu.log" | awk '{print $2, $4}') > "$out/lm_pairs.txt"
  # float32 on both, sums in other orders: the trajectories drift apart by rounding only.
  if [ "$(wc -l < "$out/lm_pairs.txt")" -ge 4 ] &&
     awk '{ d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 1e-2 * $2 + 1e-3) bad = 1 } END { exit bad }' \
       "$out/lm_pairs.txt"; then
    record lm pass "losses agree at $(wc -l < "$out/lm_pairs.txt") logged steps"
  else
    record lm FAIL "per-step losses differ: $(tr '\n' ';' < "$out/lm_pairs.txt")"
  fi
}

# nvidia-smi's view of which processes hold memory on which GPU, sampled while `pids`
# (a file of "label pid" lines, filled by the runs) train; then every pid must appear on
# its expected GPU index and nowhere else.
gpu_of_pids() {  # prints "pid gpu_index" for every compute process, once
  local map
  map="$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader | tr -d ' ')"
  nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader | tr -d ' ' | while IFS=, read -r pid uuid; do
    echo "$pid $(grep -F ",$uuid" <<< "$map" | cut -d, -f1)"
  done
}

gpu_memory() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits | tr -d ' '; }

watch_and_check() {  # name expected_file run_pid
  local name="$1" expected="$2" runner="$3" seen="$out/$1.seen" mem="$out/$1.mem"
  : > "$seen"
  gpu_memory | sed 's/^/before,/' > "$mem"
  while kill -0 "$runner" 2>/dev/null; do
    gpu_of_pids >> "$seen"
    gpu_memory | sed 's/^/during,/' >> "$mem"
    sleep 0.5
  done
  wait "$runner" || { record "$name" FAIL "the run failed (logs in $out)"; return; }
  sort -u "$seen" -o "$seen"
  local bad="" label pid want got visible=0
  while read -r label pid want; do
    got="$(awk -v p="$pid" '$1 == p { print $2 }' "$seen" | sort -u | tr '\n' ' ')"
    [ -n "$got" ] && visible=1
    if [ "$got" != "$want " ]; then bad+="$label (pid $pid) held memory on GPU(s) [${got% }], expected [$want]; "; fi
  done < "$expected"
  if [ "$visible" -eq 0 ]; then
    # nvidia-smi shows another PID namespace's ids (a container): judge by memory instead,
    # which tells GPUs apart only when one process runs.
    if [ "$(wc -l < "$expected")" -ne 1 ]; then
      record "$name" skipped "nvidia-smi does not show this container's process ids"
      return
    fi
    want="$(awk '{ print $3 }' "$expected")"
    bad="$(awk -F, -v want="$want" '$1 == "before" { base[$2] = $3 } $1 == "during" && $3 - base[$2] > max[$2] { max[$2] = $3 - base[$2] }
             END { for (g in max) if (g != want && max[g] > 100) printf "GPU %s grew by %d MiB; ", g, max[g]; if (max[want] <= 100) printf "GPU %s (its own) did not grow; ", want }' "$mem")"
  fi
  if [ -z "$bad" ]; then record "$name" pass "$(wc -l < "$expected") process(es), each on its own GPU only"
  else record "$name" FAIL "$bad"; fi
}

step_smi() {
  local gpus last
  gpus="$("$carry/cuda_devices")"
  last=$((gpus - 1))
  local train=(train "$carry/mlp.yaml" --set train.steps=300 --set train.log_interval=100)
  # One process, both stages on the last GPU: nothing on GPU 0 unless that is it.
  "$carry/gpipe" "${train[@]}" --set "pipeline.devices=[cuda:$last,cuda:$last]" --set output.dir="$out/smi1" \
    > "$out/smi_single.log" 2>&1 &
  local runner=$!
  echo "single $runner $last" > "$out/smi_single.expected"
  watch_and_check smi_single "$out/smi_single.expected" "$runner"
  if [ "$gpus" -lt 2 ] || ! command -v mpirun > /dev/null; then
    record smi_ranks skipped "needs mpirun and two GPUs ($gpus visible)"
    return
  fi
  # One rank per GPU: each writes "rank pid expected_gpu" and becomes gpipe (same pid).
  rm -f "$out/smi_ranks.expected"
  mpirun --allow-run-as-root --oversubscribe -np "$gpus" bash -c \
    "echo \"rank\$OMPI_COMM_WORLD_RANK \$\$ \$OMPI_COMM_WORLD_LOCAL_RANK\" >> '$out/smi_ranks.expected'; exec '$carry/gpipe' \"\$@\"" \
    _ "${train[@]}" --set pipeline.partitions="$gpus" --set "pipeline.devices=[$(yes cuda | head -n "$gpus" | paste -sd,)]" \
    --set output.dir="$out/smi_ranks" > "$out/smi_ranks.log" 2>&1 &
  runner=$!
  sleep 2  # the ranks write their lines first
  watch_and_check smi_ranks "$out/smi_ranks.expected" "$runner"
}

step_nccl() {
  local gpus
  gpus="$("$carry/cuda_devices")"
  if [ "$gpus" -lt 2 ] || ! command -v mpirun > /dev/null; then
    record nccl skipped "needs mpirun and two GPUs ($gpus visible)"
    return
  fi
  # The test cases (a grouped exchange both ways among them), then a stuck peer for each
  # kind of wait on NCCL work: the job must end at the deadline with status 75.
  if timeout 600 bash "$carry/nccl_transport_test.sh" "$carry/nccl_transport_check" \
       > "$out/nccl_transport_test.log" 2>&1 &&
     grep -q '^nccl_transport_test: ok' "$out/nccl_transport_test.log"; then
    record nccl_transport_test pass "both ranks ok; stuck send, receive and all-reduce end the job at the deadline"
  else
    record nccl_transport_test FAIL "$out/nccl_transport_test.log"
  fi
  if TEST_TMPDIR="$out" bash "$carry/nccl_train_test.sh" "$carry/gpipe" "$carry/mlp.yaml" "$carry/cuda_devices" \
       > "$out/nccl_train_test.log" 2>&1; then
    record nccl_train_test pass "$(grep -c '^ok' "$out/nccl_train_test.log") checks"
  else
    record nccl_train_test FAIL "$out/nccl_train_test.log"
  fi
}

step_bench() {
  : > "$out/bench.jsonl"
  local h k ok=1
  for h in 1024 2048; do
    timeout 300 "$carry/block_bench" --device cuda:0 --hidden "$h" --heads 16 --seq 512 --batch 8 --blocks 4 --steps 20 \
      >> "$out/bench.jsonl" 2>> "$out/bench.err" || ok=0
    if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
      python3 "$carry/torch_block.py" --device cuda --hidden "$h" --heads 16 --seq 512 --batch 8 --blocks 4 --steps 20 \
        >> "$out/bench.jsonl" 2>> "$out/bench.err" || true
    fi
  done
  # A K-stage pipeline on this one GPU against K = 1 (the stages take turns on its
  # stream; step_ms waits for the device, the per-stage timings are the host's queuing).
  : > "$out/pipeline.jsonl"
  for k in 1 2 4; do
    timeout 300 "$carry/pipeline_bench" --device cuda:0 --k "$k" --m 8 --checkpoint except_last --width 4096 --depth 16 \
      --batch 1024 --steps 20 --warmup 3 --no-pin --table >> "$out/pipeline.jsonl" 2>> "$out/pipeline.err" || ok=0
  done
  if [ "$ok" -eq 1 ] && python3 - "$out/bench.jsonl" "$out/pipeline.jsonl" > "$out/bench_table.txt" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'bench':<12} {'hidden':>6} {'step ms':>9} {'GFLOP/s':>9} {'GEMM GFLOP/s':>13} {'fraction':>8}")
for r in rows:
    print(f"{r['bench']:<12} {r['hidden']:>6} {r['step_ms']:>9.2f} {r.get('achieved_gflops', float('nan')):>9.0f} "
          f"{r.get('gemm_gflops', float('nan')):>13.0f} {r.get('fraction_of_gemm_rate', float('nan')):>8.2f}")
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
assert len(rows) == 3, f"{len(rows)} pipeline results, 3 expected"
print(f"{'pipeline on cuda:0':<20} {'step ms':>9} {'ideal bubble':>13}")
for r in rows:
    print(f"K={r['k']}, M={r['m']:<14} {r['step_ms']:>9.2f} {r['ideal_bubble']:>13.3f}")
PY
  then
    record bench pass "tables in $out/bench_table.txt"
  else
    record bench FAIL "a benchmark failed or wrote no result ($out/bench.err, $out/pipeline.err)"
  fi
}

run() {
  out="${OUT:-/tmp/gpu_check}"
  mkdir -p "$out"
  [ -d "$carry/lib" ] || tar -C "$carry" -xJf "$carry/lib.tar.xz" ||
    { echo "gpu_check: cannot unpack $carry/lib.tar.xz; run prepare here first" >&2; exit 2; }
  local cuda_libs
  cuda_libs="$(ls -d /usr/local/cuda*/lib64 2>/dev/null | tr '\n' ':')"
  cuda_libs+="$(ldconfig -p | awk '/libcublas|libnccl|libcudnn/ { sub(/\/[^\/]*$/, "", $NF); print $NF }' | sort -u | tr '\n' ':')"
  # Where the image has them only as Python wheels (nvidia-cudnn-cu13, nvidia-nccl-cu13, ...).
  cuda_libs+="$(find /usr/local /opt /usr/lib -xdev \( -name 'libcudnn.so.9' -o -name 'libnccl.so.2' -o -name 'libcublas.so.13' \
                  -o -name 'libcudart.so.13' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')"
  export LD_LIBRARY_PATH="$PWD/$carry/lib:${cuda_libs}${LD_LIBRARY_PATH:-}"
  export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA's device numbers are nvidia-smi's
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 ||
    { echo "gpu_check: nvidia-smi failed; is this the GPU machine?" >&2; exit 2; }
  [ "$("$carry/cuda_devices")" -ge 1 ] || { echo "gpu_check: no CUDA device visible to the carried binaries" >&2; exit 2; }
  local steps=("$@") s
  [ "${#steps[@]}" -gt 0 ] || steps=(tests sanitize lm smi nccl bench)
  for s in "${steps[@]}"; do
    case "$s" in
      tests|sanitize|lm|smi|nccl|bench) "step_$s" ;;
      *) echo "gpu_check: unknown step '$s'; use tests, sanitize, lm, smi, nccl or bench" >&2; exit 2 ;;
    esac
  done
  echo "GPU: $(tail -n 1 "$out/gpu.txt")"
  [ -f "$out/bench_table.txt" ] && cat "$out/bench_table.txt"
  printf '%s' "$results" | awk -F'|' '{ printf "%-34s %-8s %s\n", $1, $2, $3 }'
  if failed; then echo "gpu_check: FAILED"; exit 1; fi
  echo "gpu_check: all checks passed or were skipped (skips say why)"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bench/gpu_check.sh prepare | run [tests|sanitize|lm|smi|nccl|bench]..." >&2; exit 2 ;;
esac
