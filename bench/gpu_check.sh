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
#         speed     gpipe against PyTorch on the same LLaMA-style models (bench/torch_llama.py;
#                   bench/configs/llama_95m_speed.yaml, llama_1b_speed.yaml): bf16 and
#                   float32, gpipe at K = 1, 2, 4 stages on one GPU (M = K), and K = 1 at
#                   M = 4 and K = 4 at M = 1, which split K = 4's extra time between its
#                   thinner micro-batches and its stages; one table of step times,
#                   PyTorch/gpipe ratios, MFU and peak memory, and $OUT/speed.md to paste into
#                   bench/RESULTS.md. A run that fails is FAIL, a slow one is not. Without
#                   torch in python3 the PyTorch half is skipped. GPU_CHECK_SPEED_* change it
#                   (see step_speed); GPU_CHECK_SPEED_DEVICE=cpu:0 GPU_CHECK_SPEED_SIZES=tiny
#                   is a smoke run on a machine without a GPU
#         plan      the planner after `gpipe profile` on the GPU: the 95M model profiled,
#                   then trained at K = 1 and 4 with the profile; planned step against
#                   measured, a FAIL beyond 20% (GPU_CHECK_PLAN_*)
#       Full logs under $OUT (or /tmp/gpu_check); the table is printed last. A step that
#       the machine cannot run (one GPU, no mpirun, no compute-sanitizer) is reported as
#       skipped, never as passed.
#
# The GPU machine has the CUDA libraries but no Bazel and no Debian packages, so the
# binaries are built here; the CUDA libraries themselves are never carried.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
carry="${GPU_CHECK_CARRY:-.gpu_carry}"  # another folder of prepare's files, e.g. for a smoke run
# GPU_CHECK_TESTS (a space-separated list) runs some of them, in tests and sanitize;
# GPU_CHECK_SANITIZE_TESTS, in sanitize only (e.g. every binary plainly, two under racecheck).
read -ra tests <<< "${GPU_CHECK_TESTS:-cuda_backend_test cuda_conv_test cuda_elementwise_test cuda_llama_test gpu_layers_test gpu_pipeline_test}"
read -ra sanitize_tests <<< "${GPU_CHECK_SANITIZE_TESTS:-${tests[*]}}"

prepare() {
  set -e
  rm -rf "$carry" && mkdir -p "$carry/lib"
  bazel build --config=cuda //kernels:cuda_backend_test //kernels:cuda_conv_test //kernels:cuda_elementwise_test \
    //kernels:cuda_llama_test //tests:gpu_layers_test \
    //tests:gpu_pipeline_test //tests:cuda_devices //runtime:nccl_transport_check //bench:block_bench \
    //bench:pipeline_bench //pipeline:gpipe >&2
  local bin
  for bin in kernels/cuda_backend_test kernels/cuda_conv_test kernels/cuda_elementwise_test kernels/cuda_llama_test \
             tests/gpu_layers_test tests/gpu_pipeline_test \
             tests/cuda_devices runtime/nccl_transport_check bench/block_bench bench/pipeline_bench pipeline/gpipe; do
    cp -L "bazel-bin/$bin" "$carry/$(basename "$bin")"
    # Every shared library it loads, except the CUDA toolkit's and the C runtime's.
    ldd "bazel-bin/$bin" | awk '/=> \// { print $3 }' | while read -r lib; do
      case "$lib" in
        */cuda*/*|*libcuda.so*|*libcudart*|*libnccl*|*libcublas*|*libcudnn*|*libnvrtc*|*/libc.so*|*/libm.so*|*/ld-linux*|*/libpthread*|*/libdl.so*|*/librt.so*) ;;
        *) cp -Ln "$lib" "$carry/lib/" ;;
      esac
    done
  done
  cp bench/torch_block.py bench/torch_llama.py bench/configs/llama_*_speed.yaml configs/default.yaml configs/mlp.yaml \
    pipeline/cli/nccl_train_test.sh runtime/nccl_transport_test.sh "$carry/"
  # What was built, for the speed step's table (the GPU machine has no git).
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . || echo ' with uncommitted changes')" > "$carry/commit.txt"
  cp /usr/share/common-licenses/GPL-3 "$carry/GPL-3"
  # The device call carries 64 MiB at most; OpenBLAS and oneDNN alone are 76 MB, 15 packed.
  tar -C "$carry" -cJf "$carry/lib.tar.xz" lib && rm -rf "$carry/lib"
  du -sh "$carry" >&2
}

# ---- run: each check appends "name|result|detail" to $results; any FAIL fails the script.
results=""
# Each verdict as it is made: kept for the table at the end, and printed and appended to
# $out/results.txt at once, so that a call killed at its limit still shows the ones made.
record() {
  results+="$1|$2|$3"$'\n'
  printf 'gpu_check: %s %s %s\n' "$1" "$2" "$3"
  printf '%s|%s|%s\n' "$1" "$2" "$3" >> "$out/results.txt"
}
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

# The kernels a racecheck hazard is reported in, one a line: "Race reported between ...
# access at KERNEL+0x..".
race_kernels() { sed -n -E 's/.*Race reported between [A-Za-z]+ access at ([A-Za-z0-9_]+)\+0x.*/\1/p' "$1" | sort -u; }

# NVIDIA's own kernels (cuBLAS's nvjet and xmma, cuDNN's generated SDPA, CUTLASS): closed
# code whose Hopper kernels synchronise through TMA and wgmma barriers, which racecheck
# does not model (the H200 run of 2026-11-28 reported hazards there and none in ours).
nvidia_kernel() { [[ "$1" =~ ^(nvjet_|cudnn_generated_|sm90_xmma|sm80_xmma|cutlass) ]]; }

# Whether racecheck reported hazards in `log` and every one of them lies in NVIDIA's kernels.
races_only_in_nvidia() {
  local k found=0
  while read -r k; do
    nvidia_kernel "$k" || return 1
    found=1
  done < <(race_kernels "$1")
  [ "$found" -eq 1 ]
}

step_sanitize() {
  local sanitizer tool t
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
  if [ -z "$sanitizer" ]; then
    record sanitize skipped "no compute-sanitizer on this machine"
    return
  fi
  for tool in ${GPU_CHECK_SANITIZERS:-memcheck racecheck synccheck}; do
    for t in "${sanitize_tests[@]}"; do
      local log="$out/$t.$tool.log" exclude='*out of memory is a UserError*'
      # --error-exitcode: a finding fails the run even when the test itself passes. The
      # allocator's out-of-memory case asks for more than the card has on purpose, and the
      # sanitizer counts the refused cudaMalloc as an error: it runs in `tests`, not here.
      # cuDNN's SDPA kernels do not launch under synccheck on Hopper (an unspecified launch
      # failure in the H200 run): the fused attention case runs under memcheck and racecheck.
      # Nor does synccheck follow a captured step's graph: its table of barriers overflows
      # and a kernel then fails to launch (the H200 run of 2026-11-29; with a larger table,
      # --num-cuda-barriers, the tool runs out of memory). The capture cases run under
      # memcheck (clean there) and racecheck.
      [ "$tool" = synccheck ] && exclude+=',*fused attention*,*captured*'
      # GPU_CHECK_SANITIZE_ARGS: more of the sanitizer's options (e.g. --num-cuda-barriers N).
      # GPU_CHECK_SANITIZE_CASES: only the test cases whose names match (doctest's
      # --test-case, e.g. '*residual*,*rmsnorm*'), for a tool too slow for a whole binary in
      # the time a session has (racecheck of cuda_backend_test and gpu_pipeline_test).
      local cases=()
      [ -n "${GPU_CHECK_SANITIZE_CASES:-}" ] && cases=(--test-case="$GPU_CHECK_SANITIZE_CASES")
      # shellcheck disable=SC2086
      timeout "${GPU_CHECK_SANITIZE_TIMEOUT:-900}" "$sanitizer" --tool "$tool" --error-exitcode 97 \
        ${GPU_CHECK_SANITIZE_ARGS:-} "$carry/$t" \
        --test-case-exclude="$exclude" "${cases[@]}" > "$log" 2>&1
      local status=$? only=""
      [ -n "${GPU_CHECK_SANITIZE_CASES:-}" ] && only=", only the cases '$GPU_CHECK_SANITIZE_CASES'"
      if [ -n "$only" ] && grep -qE 'test cases: +0 \|' "$log"; then
        if [ "$tool" = synccheck ]; then  # its own exclusions may have taken every case that matched
          record "$t/$tool" skipped "no test case ran: none matched GPU_CHECK_SANITIZE_CASES='$GPU_CHECK_SANITIZE_CASES', or each one that did is one synccheck leaves out (fused attention, captured steps) ($log)"
        else
          record "$t/$tool" FAIL "no test case matched GPU_CHECK_SANITIZE_CASES='$GPU_CHECK_SANITIZE_CASES' ($log)"
        fi
      elif [ "$status" -eq 0 ]; then
        record "$t/$tool" pass "$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log")$only"
      elif [ "$status" -eq 124 ]; then
        record "$t/$tool" FAIL "did not finish in ${GPU_CHECK_SANITIZE_TIMEOUT:-900} s ($log)"
      elif [ "$tool" = racecheck ] && grep -q 'test cases:.* 0 failed' "$log" && races_only_in_nvidia "$log"; then
        record "$t/$tool" pass "hazards only inside NVIDIA's kernels ($(race_kernels "$log" | sed -E 's/_kernel0_0$//' |
          cut -c1-40 | sort -u | paste -sd' ')), none in ours$only ($log)"
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

# ---- speed: gpipe against PyTorch on the same LLaMA-style model, on the same GPU.
# The most memory in use on GPU `gpu` while process `pid` runs, in MiB above `base`:
# nvidia-smi's whole-GPU figure every 0.2 s, so the runs go one at a time. It counts the
# CUDA context and what each allocator caches, for both sides alike.
gpu_used_mib() { nvidia-smi -i "$1" --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | tr -d ' '; }
gpu_peak_mib() {  # pid gpu base
  local peak="$3" used
  while kill -0 "$1" 2>/dev/null; do
    used="$(gpu_used_mib "$2")"
    [[ "$used" =~ ^[0-9]+$ ]] && [ "$used" -gt "$peak" ] && peak="$used"
    sleep 0.2
  done
  echo $((peak - $3))
}

# "K", "KmM", "Kg" or "KmMg" (GPU_CHECK_SPEED_KS) into k, m, capture and the run's name in
# its folder (kK, kKmM when M is not K, then g when captured); a malformed one is an error.
speed_km() {
  local token="$1"
  [[ "$token" =~ ^([1-9][0-9]*)(m([1-9][0-9]*))?(g?)$ ]] ||
    { echo "gpu_check: '$token' in GPU_CHECK_SPEED_KS or _OPS_KS is not K, KmM, Kg or KmMg (e.g. 4, 4m1g)" >&2; return 1; }
  k="${BASH_REMATCH[1]}" m="${BASH_REMATCH[3]:-${GPU_CHECK_SPEED_M:-${BASH_REMATCH[1]}}}"
  capture=false km_name="k$k"
  [ "$m" = "$k" ] || km_name+="m$m"
  [ -z "${BASH_REMATCH[4]}" ] || { capture=true; km_name+=g; }
}

# Runs one timed job (command in "$@", its output to `log`) within `limit` seconds, the
# GPU's memory sampled while it runs; appends its row to $out/speed.jsonl for the table.
# A job past its limit is killed outright: gpipe would save a checkpoint on SIGTERM.
speed_run() {  # json_fields log limit command...
  local fields="$1" log="$2" limit="$3" base="" mib=null status begin=$SECONDS
  shift 3
  [ -n "$speed_gpu" ] && base="$(gpu_used_mib "$speed_gpu")"
  timeout -s KILL "$limit" "$@" > "$log" 2>&1 &
  local pid=$!
  [[ "$base" =~ ^[0-9]+$ ]] && mib="$(gpu_peak_mib "$pid" "$speed_gpu" "$base")"
  wait "$pid"
  status=$?
  printf '{%s, "log": "%s", "status": %d, "seconds": %d, "limit_s": %d, "gpu_mib": %s}\n' \
    "$fields" "$log" "$status" $((SECONDS - begin)) "$limit" "$mib" >> "$out/speed.jsonl"
}

# Sizes (llama_<size>_speed.yaml in $carry), precisions, stage counts, steps (the median of
# the last GPU_CHECK_SPEED_TIMED of them), M (default K), recompute and the device can be
# changed with GPU_CHECK_SPEED_*. Each run gets GPU_CHECK_SPEED_TIMEOUT seconds at most and
# the step GPU_CHECK_SPEED_BUDGET in all: a run that the budget leaves no time for is
# reported as not run (skipped, saying so), a run that outlasts its limit as FAIL.
step_speed() {
  local sizes ks precisions size precision k m dir
  read -ra sizes <<< "${GPU_CHECK_SPEED_SIZES:-95m 1b}"
  read -ra precisions <<< "${GPU_CHECK_SPEED_PRECISIONS:-bf16 float32}"
  # Each run is "K", "KmM" or either with "g" after it (speed_km): K stages on the one GPU,
  # M micro-batches (GPU_CHECK_SPEED_M, or K), "g" with pipeline.capture (the training step
  # of the K stages captured as one CUDA graph and replayed, one launch a step). "1m4g" and
  # "4m1g" split K = 4's extra time: the same kernels as K = 4 at K = 1, and K = 4's stages
  # with K = 1's kernels (on one GPU the stages take turns, so M buys no overlap). The
  # captured runs come first, so that a spent budget leaves out uncaptured K = 2 and 4.
  read -ra ks <<< "${GPU_CHECK_SPEED_KS:-1 1g 2g 4g 4m1g 1m4g 2 4}"
  local steps="${GPU_CHECK_SPEED_STEPS:-12}" timed="${GPU_CHECK_SPEED_TIMED:-8}"
  local recompute="${GPU_CHECK_SPEED_RECOMPUTE:-never}" per_run="${GPU_CHECK_SPEED_TIMEOUT:-180}"
  local budget="${GPU_CHECK_SPEED_BUDGET:-360}" started=$SECONDS
  speed_device="${GPU_CHECK_SPEED_DEVICE:-cuda:0}" speed_gpu=""  # nvidia-smi's index of a cuda device
  [[ "$speed_device" == cuda* ]] && { speed_gpu="${speed_device#cuda}"; speed_gpu="${speed_gpu#:}"; speed_gpu="${speed_gpu:-0}"; }
  : > "$out/speed.jsonl"
  local torch_device="${speed_device%%:*}" torch_why=""
  [ "$torch_device" = cuda ] && torch_device="$speed_device"
  if ! torch_why="$(python3 -c "import torch, sys; sys.exit(0 if '$torch_device' == 'cpu' or torch.cuda.is_available()
                                 else 'torch ' + torch.__version__ + ' sees no CUDA device')" 2>&1)"; then
    record speed_pytorch skipped "no PyTorch to run in python3 ($(tail -n 1 <<< "$torch_why")): gpipe's runs only"
    torch_device=""
  fi
  # Runs left out when the budget is spent: "size precision what" lines, for the table's notes.
  : > "$out/speed_not_run.txt"
  rm -rf "$out"/speed_*_ops "$out"/speed_*_ops.log  # an earlier call's: the tables read every one there
  # Where a step's time goes, op by op (trace.ops), for the first size and precision, at each
  # run of GPU_CHECK_SPEED_OPS_KS ("1 4 4m1", as speed_km reads them), so that the tables
  # show which ops K = 4's extra time is in: runs of their own, since two events around
  # every op slow a step whose host is its bound; first, so that the budget the timed runs
  # share cannot leave them out. GPU_CHECK_SPEED_OPS=0 leaves them out.
  local ops_size="${sizes[0]}" ops_precision="${precisions[0]}" ops_ks ops_k capture km_name
  read -ra ops_ks <<< "${GPU_CHECK_SPEED_OPS_KS:-1 4 4m1}"
  if [ "${GPU_CHECK_SPEED_OPS:-1}" != 0 ] && [ -f "$carry/llama_${ops_size}_speed.yaml" ]; then
    for ops_k in "${ops_ks[@]}"; do
      speed_km "$ops_k" || { record "speed_ops_$ops_k" FAIL "not a run of GPU_CHECK_SPEED_OPS_KS"; continue; }
      [ "$capture" = false ] ||
        { record "speed_ops_$ops_k" FAIL "trace.ops times a step op by op, so GPU_CHECK_SPEED_OPS_KS takes no captured (g) run"; continue; }
      local left=$((budget - (SECONDS - started)))
      dir="$out/speed_${ops_size}_${ops_precision}$([ "$km_name" = k1 ] || echo "_$km_name")_ops"
      rm -rf "$dir"
      if [ "$left" -ge 30 ]; then
        timeout "$((left < per_run ? left : per_run))" "$carry/gpipe" train "$carry/llama_${ops_size}_speed.yaml" \
          --set "model.dtype=$ops_precision" --set "pipeline.partitions=$k" --set "pipeline.micro_batches=$m" \
          --set "pipeline.devices=[$(yes "$speed_device" | head -n "$k" | paste -sd,)]" \
          --set "pipeline.recompute=$recompute" --set "train.steps=6" \
          --set "trace.ops=true" --set "data.path=$carry/GPL-3" --set "output.dir=$dir" > "$dir.log" 2>&1 ||
          record "speed_ops_${ops_size}_${ops_precision}_$km_name" FAIL "gpipe with trace.ops: exit status $? ($dir.log)"
      else
        echo "$ops_size $ops_precision gpipe $ops_k with trace.ops" >> "$out/speed_not_run.txt"
      fi
    done
  fi
  for size in "${sizes[@]}"; do
    local config="$carry/llama_${size}_speed.yaml"
    [ -f "$config" ] || { record "speed_$size" FAIL "no $config (run prepare; sizes: GPU_CHECK_SPEED_SIZES)"; continue; }
    for precision in "${precisions[@]}"; do
      local label="\"size\": \"$size\", \"config\": \"$config\", \"precision\": \"$precision\""
      for k in torch "${ks[@]}"; do  # PyTorch first: a budget spent leaves gpipe's last K out
        [ "$k" = torch ] && [ -z "$torch_device" ] && continue
        local left=$((budget - (SECONDS - started)))
        if [ "$left" -lt 30 ]; then
          echo "$size $precision $([ "$k" = torch ] && echo PyTorch || echo "gpipe $k")" >> "$out/speed_not_run.txt"
          continue
        fi
        local limit=$((left < per_run ? left : per_run))
        if [ "$k" = torch ]; then
          speed_run "\"impl\": \"pytorch\", $label" "$out/speed_${size}_${precision}_torch.log" "$limit" \
            python3 "$carry/torch_llama.py" --config "$config" --device "$torch_device" --precision "$precision" \
            --steps "$steps" --timed "$timed" $([ "$torch_device" = cpu ] && echo --threads 1)  # a CPU stage's one thread
          continue
        fi
        speed_km "$k" || { record "speed_$k" FAIL "not a run of GPU_CHECK_SPEED_KS"; continue; }
        dir="$out/speed_${size}_${precision}_$km_name"
        rm -rf "$dir"
        speed_run "\"impl\": \"gpipe\", $label, \"k\": $k, \"m\": $m, \"capture\": $capture, \"dir\": \"$dir\"" \
          "$dir.log" "$limit" \
          "$carry/gpipe" train "$config" --set "model.dtype=$precision" --set "pipeline.partitions=$k" \
          --set "pipeline.micro_batches=$m" --set "pipeline.devices=[$(yes "$speed_device" | head -n "$k" | paste -sd,)]" \
          --set "pipeline.recompute=$recompute" --set "train.steps=$steps" --set "trace.steps=[1,$steps]" \
          --set "pipeline.capture=$capture" --set "data.path=$carry/GPL-3" --set "output.dir=$dir"
      done
    done
  done
  local gpu_name="cpu" driver="" lines
  if [ -n "$speed_gpu" ]; then
    gpu_name="$(nvidia-smi -i "$speed_gpu" --query-gpu=name --format=csv,noheader)"
    driver="$(nvidia-smi -i "$speed_gpu" --query-gpu=driver_version --format=csv,noheader)"
  fi
  # The table, the markdown fragment and one record per size and precision ("name|result|detail").
  if lines="$(python3 - "$out" "$carry" "$steps" "$timed" "$gpu_name" "$driver" "$run_command" "$recompute" \
                2> "$out/speed_table.err" <<'PY'
import datetime, json, os, statistics, sys
out, carry, steps, timed, gpu_name, driver, command, recompute = sys.argv[1:9]
timed = int(timed)
sys.path.insert(0, carry)
from torch_llama import model_flops, parameter_counts, shape_from_config  # no torch needed

# Dense (no sparsity) peaks of the datasheets, by nvidia-smi's name; GPU_CHECK_SPEED_PEAK_TFLOPS
# ("bf16=989,float32=67") gives others. float32 is the plain one: TF32 is off on both sides.
PEAKS = [("H100 PCIe", {"bf16": 756e12, "float32": 51e12}), ("H100 NVL", {"bf16": 835e12, "float32": 60e12}),
         ("H100", {"bf16": 989e12, "float32": 67e12}), ("H200", {"bf16": 989e12, "float32": 67e12})]
peaks, peak_source = {}, ""
if os.environ.get("GPU_CHECK_SPEED_PEAK_TFLOPS"):
    peaks = {k: float(v) * 1e12 for k, v in (p.split("=") for p in os.environ["GPU_CHECK_SPEED_PEAK_TFLOPS"].split(","))}
    peak_source = "GPU_CHECK_SPEED_PEAK_TFLOPS"
else:
    for key, p in PEAKS:
        if key in gpu_name:
            peaks, peak_source = p, f"the {key} datasheet's dense figures"
            break

rows = [json.loads(l) for l in open(os.path.join(out, "speed.jsonl")) if l.strip()]
def fail_why(r):
    if r["status"] == 137 and r["seconds"] >= r["limit_s"] - 1:
        return f"did not finish in {r['limit_s']} s"
    return f"exit status {r['status']}" if r["status"] else ""

def measure(r):
    """(step ms, allocator MiB) of a run, or raises ValueError saying why not."""
    if r["impl"] == "pytorch":
        found = [json.loads(l) for l in open(r["log"]) if l.startswith('{"bench": "torch_llama"')]
        if not found:
            raise ValueError("printed no result")
        r["torch"] = found[-1]
        alloc = found[-1].get("max_memory_allocated")
        return found[-1]["step_ms"], None if alloc is None else alloc / 2**20
    trace = json.load(open(os.path.join(r["dir"], "trace.json")))
    walls = {e["args"]["step"]: e["args"]["wall_ms"] for e in trace["traceEvents"] if e.get("cat") == "step"}
    steps = sorted(walls)
    if len(steps) < timed:
        raise ValueError(f"trace.json holds {len(steps)} steps, {timed} wanted")
    report = json.load(open(os.path.join(r["dir"], "report.json")))
    # The step the run's plan predicted before its first step (stages sharing the GPU take turns there).
    r["planned_ms"] = report.get("prediction", {}).get("step_ms")
    # The GPU's allocator at its most from the run's first step (every stage on it reads the one count),
    # as PyTorch's max_memory_allocated counts; a report from before it: the plan's weights,
    # gradients and optimizer state plus the measured peak activations.
    own = max((st.get("device_peak_bytes", 0) for st in report["stages"]), default=0)
    if own <= 0:
        r["alloc_planned"] = True
        own = sum(q["weight_bytes"] + q["gradient_bytes"] + q["optimizer_bytes"] for q in report["prediction"]["stages"]) + \
            sum(st["peak_activation_bytes"] for st in report["stages"])
    return statistics.median(walls[s] for s in steps[-timed:]), own / 2**20

groups = {}
for r in rows:
    groups.setdefault((r["size"], r["precision"]), []).append(r)
header = ["model", "parameters", "precision", "run", "K", "M", "step ms", "planned ms (plan / measured)",
          "PyTorch / this", "MFU", "GPU memory MiB (nvidia-smi)", "allocated MiB"]
table, records, torch_version = [], [], ""
for (size, precision), rs in groups.items():
    shape = shape_from_config(rs[0]["config"])
    shape["precision"] = precision
    params = parameter_counts(shape)[0]
    flops = model_flops(shape)
    problems, times = [], {}
    for r in rs:
        what = "PyTorch" if r["impl"] == "pytorch" else f"gpipe K={r['k']}" + \
            (f" M={r['m']}" if r["m"] != r["k"] else "") + (" captured" if r.get("capture") else "")
        why = fail_why(r)
        if not why:
            try:
                r["ms"], r["alloc"] = measure(r)
                times[what] = r["ms"]
            except (OSError, ValueError, KeyError) as e:
                why = f"no timings ({e})"
        if why:
            problems.append(f"{what}: {why} ({r['log']})")
    torch_ms = times.get("PyTorch")
    for r in rs:
        if "ms" not in r:
            continue
        if r["impl"] == "pytorch":
            torch_version = r["torch"]["torch"]
        mfu = flops / (r["ms"] / 1e3) / peaks[precision] if precision in peaks else None
        table.append([f"llama_{size}_speed", f"{params / 1e6:.1f} M", precision,
                      "PyTorch eager" if r["impl"] == "pytorch" else
                      "gpipe, captured" if r.get("capture") else "gpipe",
                      "" if r["impl"] == "pytorch" else str(r["k"]), "" if r["impl"] == "pytorch" else str(r["m"]),
                      f"{r['ms']:.2f}",
                      "" if not r.get("planned_ms") else f"{r['planned_ms']:.2f} ({r['planned_ms'] / r['ms']:.2f})",
                      "" if r["impl"] == "pytorch" or torch_ms is None else f"{torch_ms / r['ms']:.2f}",
                      "n/a" if mfu is None else f"{100 * mfu:.1f}%",
                      "n/a" if r["gpu_mib"] is None else str(r["gpu_mib"]),
                      "n/a" if r["alloc"] is None else f"{r['alloc']:.0f}" + (" (planned)" if r.get("alloc_planned") else "")])
    ratios = ", ".join(f"{w} {ms:.2f} ms" + (f" ({torch_ms / ms:.2f})" if torch_ms and w != "PyTorch" else "")
                       for w, ms in times.items())
    if problems:
        records.append(f"speed_{size}_{precision}|FAIL|{'; '.join(problems)}")
    else:
        records.append(f"speed_{size}_{precision}|pass|{ratios}" + (" (PyTorch ms / gpipe ms)" if torch_ms else ""))

attention = {r["precision"]: r["torch"]["attention"] for rs in groups.values() for r in rs if "torch" in r}
not_run = [l.strip() for l in open(os.path.join(out, "speed_not_run.txt")) if l.strip()]
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
build = open(os.path.join(carry, "commit.txt")).read().strip() if os.path.exists(os.path.join(carry, "commit.txt")) \
    else "unknown (no commit.txt from prepare)"
peak_text = ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in peaks.items()) + f" ({peak_source})" if peaks else \
    f"none known for '{gpu_name}' (set GPU_CHECK_SPEED_PEAK_TFLOPS=bf16=...,float32=...): no MFU"
md = [f"## Speed against PyTorch: {gpu_name} ({date})", "",
      f"`{command}` ({', '.join(f'{k}={v}' for k, v in sorted(os.environ.items()) if k.startswith('GPU_CHECK_SPEED_')) or 'defaults'}). "
      f"GPU: {gpu_name}" + (f", driver {driver}" if driver else "") +
      f". PyTorch: {torch_version or 'not run'}. gpipe: built at {build}.", "",
      "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
md += ["| " + " | ".join(row) + " |" for row in table]
md += ["", f"Each run trains the config's model for {steps} steps and times the median "
       f"of the last {timed} (gpipe: trace.json's per-step wall time, which ends when every stage has waited for "
       "its device; PyTorch: its clock around each step, the device waited for). Both: AdamW (PyTorch's fused=True), clip_grad_norm 1.0; "
       "bf16 is bfloat16 compute with float32 master weights (PyTorch: autocast), float32 has TF32 off on both. "
       f"gpipe: recompute {recompute}, M micro-batches, its K stages all on the one GPU; captured: "
       "pipeline.capture, the training step (of all K stages together) captured once and replayed (a CUDA graph, "
       "one launch a step; on CPU stages the recorded calls). PyTorch: eager, "
       "F.scaled_dot_product_attention (causal; grouped-query attention by " +
       ("; ".join(f"{p}: {a}" for p, a in attention.items()) or "not run") +
       "), random byte tokens (gpipe reads the GPL-3 text; the speed does not depend on the values).",
       "PyTorch / this: PyTorch's step time over the row's, above 1 when gpipe is faster. "
       "MFU: model FLOPs per step over the step time over the peak; FLOPs = tokens x (6 N + 12 L T d), N the "
       "parameters of matrix products (the embedding and the norms left out), L blocks, T the sequence, d the width "
       f"(PaLM's count: attention not halved for causality, no recompute); peak: {peak_text}.",
       "GPU memory: nvidia-smi's memory.used every 0.2 s during the run, above what was used before it (CUDA "
       "context and allocator caches included, alike for both). allocated: the most the allocator had handed out "
       "at once during the steps (every tensor, temporaries included, not its cache): PyTorch's "
       "torch.cuda.max_memory_allocated, gpipe's report.json device_peak_bytes (from its first step; its stages on the one GPU "
       "read the one count). \"(planned)\": a gpipe that reports none, given as its plan's weights, gradients and "
       "optimizer state plus the measured peak activations, summed over the stages."]
# Each K = 1 run's matrix products, timed alone after it (report.json's gemms: the longest
# per micro-batch first), against the datasheet peak of the MFU column and the one gpipe probed.
gemm_rows = []
for r in rows:
    if r["impl"] != "gpipe" or r.get("k") != 1 or r.get("m") != 1 or r.get("capture") or "ms" not in r:
        continue
    try:
        gemms = json.load(open(os.path.join(r["dir"], "report.json"))).get("gemms", [])
    except (OSError, ValueError):
        continue
    for g in gemms[:5]:
        sheet = f"{100 * g['flops_per_second'] / peaks[r['precision']]:.1f}%" if r["precision"] in peaks else "-"
        probed = f"{100 * g['peak_fraction']:.1f}%" if "peak_fraction" in g else "-"
        ops = ("T" if g["trans_a"] else "N") + ("T" if g["trans_b"] else "N")  # op(a), op(b): BLAS's letters
        # Attention (and a convolution) is an op of several products: its operands instead.
        sizes = g["operands"] if g.get("operands") else f"{g['m']}x{g['n']}x{g['k']} {ops}"
        gemm_rows.append([f"llama_{r['size']}_speed", r["precision"], g["op"], sizes,
                          g["phases"], str(g["calls_per_micro_batch"]), f"{g['ms']:.3f}",
                          f"{g['flops_per_second'] / 1e12:.4g}", sheet, probed])
if gemm_rows:
    gh = ["model", "precision", "op", "m x n x k, a b transposed (or the op's operands)", "phase", "calls a micro-batch", "ms a call", "TFLOP/s",
          "of the datasheet peak", "of the probed peak"]
    md += ["", "Matrix products and attention of gpipe's K = 1 runs, each timed alone on the GPU after the run "
           "(report.json's gemms, the 5 longest per micro-batch; device time between two CUDA events):", "",
           "| " + " | ".join(gh) + " |", "|" + "---|" * len(gh)]
    md += ["| " + " | ".join(row) + " |" for row in gemm_rows]
# The trace.ops runs: each run's ops by their time a step, summed over its stages (report.json's
# stages[].op_times; K stages take turns on the one GPU, so their sums add up to its busy time),
# and where K = 1 and K > 1 ran for one size and precision, the ops side by side, by the
# difference: where K > 1's extra time goes.
import glob, re
op_runs = {}  # (name, k, m, captured) -> ({op: [calls, ms]}, step ms)
for path in sorted(glob.glob(os.path.join(out, "speed_*_ops", "report.json"))):
    try:
        rep = json.load(open(path))
        summed = {}
        for st in rep["stages"]:
            for o in st["op_times"]:
                e = summed.setdefault(o["op"], [0.0, 0.0])
                e[0] += o["calls_per_step"]
                e[1] += o["ms_per_step"]
        step_ms = rep["step_ms"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        continue
    name = os.path.basename(os.path.dirname(path))[len("speed_"):-len("_ops")]
    # speed_km's folder names: none for K = 1 (M = 1), else _kK, _kKmM, then g when captured.
    found = re.fullmatch(r"(.*)_k(\d+)(?:m(\d+))?(g?)", name)
    k, m, captured = 1, 1, False
    if found:
        name, k, captured = found.group(1), int(found.group(2)), found.group(4) == "g"
        m = int(found.group(3)) if found.group(3) else k
    op_runs[(name, k, m, captured)] = (summed, step_ms)
def run_label(k, m, captured):
    return f"K = {k}, M = {m}" + (", captured" if captured else "")
for (name, k, m, captured), (summed, step_ms) in sorted(op_runs.items()):
    ops = sorted(summed.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for _, v in ops)
    oh = ["op", "calls a step", "ms a step", "share of the ops' time"]
    md += ["", f"Where gpipe's step goes, op by op ({name}, {run_label(k, m, captured)}; its own run with trace.ops, two "
           f"events around every op, CUDA events on a GPU; that run's step: {step_ms:.2f} ms, its ops' device time "
           f"{total:.2f} ms" + (", summed over the stages" if k > 1 else "") + "; the 12 longest):", "",
           "| " + " | ".join(oh) + " |", "|" + "---|" * len(oh)]
    md += [f"| {op} | {v[0]:.0f} | {v[1]:.3f} | {100 * v[1] / total:.1f}% |" for op, v in ops[:12]] if total > 0 else []
# The reference: the size and precision's K = 1 run op by op, at M = 1 (or, with
# GPU_CHECK_SPEED_M, the fewest micro-batches it ran).
references = {}
for (name, k, m, captured) in sorted(op_runs):
    if k == 1 and not captured and name not in references:
        references[name] = (name, k, m, captured)
for (name, k, m, captured), (summed, step_ms) in sorted(op_runs.items()):
    if name not in references or references[name] == (name, k, m, captured):
        continue
    one, one_ms = op_runs[references[name]]
    one_label = run_label(*references[name][1:])
    names = sorted(set(one) | set(summed), key=lambda op: -(summed.get(op, [0, 0])[1] - one.get(op, [0, 0])[1]))
    t1, tk = sum(v[1] for v in one.values()), sum(v[1] for v in summed.values())
    label = run_label(k, m, captured)
    ch = ["op", f"calls, {one_label}", f"ms, {one_label}", f"calls, {label}", f"ms, {label}", "difference ms"]
    md += ["", f"{label} against {one_label}, op by op ({name}; the runs above): steps {step_ms:.2f} and {one_ms:.2f} ms, "
           f"ops {tk:.2f} and {t1:.2f} ms of device time; by the difference, the 12 largest:", "",
           "| " + " | ".join(ch) + " |", "|" + "---|" * len(ch)]
    for op in names[:12]:
        a, b = one.get(op, [0, 0]), summed.get(op, [0, 0])
        md.append(f"| {op} | {a[0]:.0f} | {a[1]:.3f} | {b[0]:.0f} | {b[1]:.3f} | {b[1] - a[1]:+.3f} |")
if not_run:
    md += ["", "Not run, the step's time budget spent: " + "; ".join(not_run) + "."]
with open(os.path.join(out, "speed.md"), "w") as f:
    f.write("\n".join(md) + "\n")
print("\n".join(records))
PY
)"; then
    local name verdict detail
    while IFS='|' read -r name verdict detail; do
      [ -z "$name" ] || record "$name" "$verdict" "$detail"
    done <<< "$lines"
    [ -s "$out/speed_not_run.txt" ] &&
      record speed_not_run skipped "the step's ${budget} s were spent before: $(paste -sd';' "$out/speed_not_run.txt")"
  else
    record speed FAIL "the table could not be made ($out/speed_table.err)"
  fi
}

# The planner after `gpipe profile` (issue 37: within 20% of the measured step on the GPU):
# the config profiled on the device at the micro-batches of K = 1 and K = 4 (M = K), then
# trained at both with that profile; each run's planned step against its measured one (the
# report's mean of the timed steps). A plan further off than 20% is a FAIL.
step_plan() {
  local size="${GPU_CHECK_PLAN_SIZE:-95m}" precision="${GPU_CHECK_PLAN_PRECISION:-bf16}"
  local dev="${GPU_CHECK_SPEED_DEVICE:-cuda:0}" k dir line
  local config="$carry/llama_${size}_speed.yaml" prof="$out/plan_${size}_profile.json"
  [ -f "$config" ] || { record plan FAIL "no $config (run prepare)"; return; }
  local batch
  batch="$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['train']['batch_size'])" "$config" 2>/dev/null ||
           sed -n -E 's/.*batch_size: *([0-9]+).*/\1/p' "$config" | head -n 1)"
  local common=(--set "model.dtype=$precision" --set "data.path=$carry/GPL-3" --set "pipeline.profile=$prof")
  if ! timeout "${GPU_CHECK_PLAN_TIMEOUT:-240}" "$carry/gpipe" profile "$config" "${common[@]}" \
         --set "pipeline.devices=[$dev]" --micro-batches "$batch,$((batch / 4))" > "$out/plan_profile.log" 2>&1; then
    record plan FAIL "gpipe profile failed ($out/plan_profile.log)"
    return
  fi
  for k in 1 4; do
    dir="$out/plan_${size}_k$k"
    rm -rf "$dir"
    if ! timeout "${GPU_CHECK_PLAN_TIMEOUT:-240}" "$carry/gpipe" train "$config" "${common[@]}" \
           --set "pipeline.partitions=$k" --set "pipeline.micro_batches=$k" \
           --set "pipeline.devices=[$(yes "$dev" | head -n "$k" | paste -sd,)]" --set "pipeline.recompute=never" \
           --set "train.steps=12" --set "output.dir=$dir" > "$dir.log" 2>&1; then
      record "plan_${size}_k$k" FAIL "gpipe train failed ($dir.log)"
      continue
    fi
    line="$(python3 - "$dir/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
planned, measured = r["prediction"]["step_ms"], r["step_ms"]
off = planned / measured - 1
src = r["prediction"]["source"]
print(("pass" if abs(off) <= 0.2 else "FAIL") +
      f"|planned {planned:.2f} ms, measured {measured:.2f} ms ({100 * off:+.1f}%); costs: {src}")
PY
)" || line="FAIL|no report ($dir)"
    record "plan_${size}_k$k" "${line%%|*}" "${line#*|}"
  done
}

run() {
  out="${OUT:-/tmp/gpu_check}"
  mkdir -p "$out"
  : > "$out/results.txt"
  [ -d "$carry/lib" ] || tar -C "$carry" -xJf "$carry/lib.tar.xz" ||
    { echo "gpu_check: cannot unpack $carry/lib.tar.xz; run prepare here first" >&2; exit 2; }
  local cuda_libs steps=("$@") s
  [ "${#steps[@]}" -gt 0 ] || steps=(tests sanitize lm smi nccl bench speed plan)
  run_command="bench/gpu_check.sh run $*"
  cuda_libs="$(ls -d /usr/local/cuda*/lib64 2>/dev/null | tr '\n' ':')"
  cuda_libs+="$(ldconfig -p | awk '/libcublas|libnccl|libcudnn|libnvrtc/ { sub(/\/[^\/]*$/, "", $NF); print $NF }' | sort -u | tr '\n' ':')"
  # Where the image has them only as Python wheels (nvidia-cudnn-cu13, nvidia-nccl-cu13, ...).
  cuda_libs+="$(find /usr/local /opt /usr/lib -xdev \( -name 'libcudnn.so.9' -o -name 'libnccl.so.2' -o -name 'libcublas.so.13' \
                  -o -name 'libcudart.so.13' -o -name 'libnvrtc.so.13' \) 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')"
  export LD_LIBRARY_PATH="$(cd "$carry" && pwd)/lib:${cuda_libs}${LD_LIBRARY_PATH:-}"
  export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA's device numbers are nvidia-smi's
  local smoke=1  # only speed and plan, on CPU stages: a smoke run without a GPU
  for s in "${steps[@]}"; do [[ "$s" == speed || "$s" == plan ]] || smoke=0; done
  [[ "${GPU_CHECK_SPEED_DEVICE:-cuda:0}" == cpu* ]] || smoke=0
  if [ "$smoke" = 1 ]; then
    echo "none: a smoke run of the ${steps[*]} step on CPU stages (GPU_CHECK_SPEED_DEVICE=$GPU_CHECK_SPEED_DEVICE)" > "$out/gpu.txt"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 ||
      { echo "gpu_check: nvidia-smi failed; is this the GPU machine?" >&2; exit 2; }
    [ "$("$carry/cuda_devices")" -ge 1 ] || { echo "gpu_check: no CUDA device visible to the carried binaries" >&2; exit 2; }
  fi
  for s in "${steps[@]}"; do
    case "$s" in
      tests|sanitize|lm|smi|nccl|bench|speed|plan) "step_$s" ;;
      *) echo "gpu_check: unknown step '$s'; use tests, sanitize, lm, smi, nccl, bench, speed or plan" >&2; exit 2 ;;
    esac
  done
  echo "GPU: $(tail -n 1 "$out/gpu.txt")"
  [ -f "$out/bench_table.txt" ] && cat "$out/bench_table.txt"
  [ -f "$out/speed.md" ] && { echo "---- $out/speed.md, for bench/RESULTS.md:"; cat "$out/speed.md"; echo "----"; }
  printf '%s' "$results" | awk -F'|' '{ printf "%-34s %-8s %s\n", $1, $2, $3 }'
  if failed; then echo "gpu_check: FAILED"; exit 1; fi
  echo "gpu_check: all checks passed or were skipped (skips say why)"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bench/gpu_check.sh prepare | run [tests|sanitize|lm|smi|nccl|bench|speed|plan]..." >&2; exit 2 ;;
esac
