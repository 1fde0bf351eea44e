#!/usr/bin/env bash
# The GPU check: what gets run when a GPU machine is lent.
#
#   bench/gpu_check.sh prepare   (here, where Bazel and the Debian libraries are)
#       builds the CUDA tests and GPU benchmarks with --config=cuda and copies them,
#       with every non-CUDA shared library they load, into .gpu_carry/ (git-ignored)
#   bench/gpu_check.sh run       (on the GPU machine, with .gpu_carry/ carried over)
#       runs the CPU-vs-CUDA conformance suite, the GPU benchmarks and a K = 1, 2, 4
#       pipeline on one GPU, full logs under
#       $OUT (or /tmp/gpu_check), and prints a short table last
#
# The GPU machine has the CUDA libraries but no Bazel and no Debian packages, so the
# binaries are built here; the CUDA libraries themselves are never carried.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
carry=.gpu_carry

prepare() {
  rm -rf "$carry" && mkdir -p "$carry/lib"
  bazel build --config=cuda //kernels:cuda_backend_test //kernels:cuda_conv_test //tests:gpu_layers_test \
    //bench:block_bench //bench:pipeline_bench //pipeline:gpipe >&2
  local bin
  for bin in kernels/cuda_backend_test kernels/cuda_conv_test tests/gpu_layers_test bench/block_bench \
             bench/pipeline_bench pipeline/gpipe; do
    cp -L "bazel-bin/$bin" "$carry/$(basename "$bin")"
    # Every shared library it loads, except the CUDA toolkit's and the C runtime's.
    ldd "bazel-bin/$bin" | awk '/=> \// { print $3 }' | while read -r lib; do
      case "$lib" in
        */cuda*/*|*libcuda.so*|*libcudart*|*libnccl*|*libcublas*|*libcudnn*|*/libc.so*|*/libm.so*|*/ld-linux*|*/libpthread*|*/libdl.so*|*/librt.so*) ;;
        *) cp -Ln "$lib" "$carry/lib/" ;;
      esac
    done
  done
  cp bench/torch_block.py configs/default.yaml "$carry/"
  cp /usr/share/common-licenses/GPL-3 "$carry/GPL-3"
  du -sh "$carry" >&2
}

run() {
  local out="${OUT:-/tmp/gpu_check}"
  mkdir -p "$out"
  local cuda_libs
  cuda_libs="$(ls -d /usr/local/cuda*/lib64 2>/dev/null | tr '\n' ':')"
  cuda_libs+="$(ldconfig -p | awk '/libcublas|libnccl|libcudnn/ { sub(/\/[^\/]*$/, "", $NF); print $NF }' | sort -u | tr '\n' ':')"
  export LD_LIBRARY_PATH="$PWD/$carry/lib:${cuda_libs}${LD_LIBRARY_PATH:-}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 || true

  local t conf summary=""
  for t in cuda_backend_test cuda_conv_test gpu_layers_test; do
    conf="FAILED"
    if "$carry/$t" > "$out/$t.log" 2>&1; then conf="passed"; fi
    grep -q GPIPE_TEST_SKIPPED "$out/$t.log" && conf="skipped (no GPU visible)"
    summary+="  $t: $conf (log: $out/$t.log)"$'\n'
  done

  : > "$out/bench.jsonl"
  local h
  for h in 1024 2048; do
    "$carry/block_bench" --device cuda:0 --hidden "$h" --heads 16 --seq 512 --batch 8 --blocks 4 --steps 20 \
      >> "$out/bench.jsonl" 2>> "$out/bench.err" || echo "{\"bench\": \"block\", \"hidden\": $h, \"error\": true}" >> "$out/bench.jsonl"
    if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
      python3 "$carry/torch_block.py" --device cuda --hidden "$h" --heads 16 --seq 512 --batch 8 --blocks 4 --steps 20 \
        >> "$out/bench.jsonl" 2>> "$out/bench.err" || true
    fi
  done

  # A K-stage pipeline on this one GPU against K = 1 (the stages take turns on its
  # stream; step_ms waits for the device, the per-stage timings are the host's queuing).
  : > "$out/pipeline.jsonl"
  local k
  for k in 1 2 4; do
    "$carry/pipeline_bench" --device cuda:0 --k "$k" --m 8 --checkpoint except_last --width 4096 --depth 16 \
      --batch 1024 --steps 20 --warmup 3 --no-pin --table >> "$out/pipeline.jsonl" 2>> "$out/pipeline.err" ||
      echo "{\"k\": $k, \"error\": true}" >> "$out/pipeline.jsonl"
  done

  # The default language model end to end: two stages sharing the GPU (tied head and
  # embedding on different stages) against the same run on two CPU stages.
  local lm=(train "$carry/default.yaml" --set "data.path=$carry/GPL-3" --set train.steps=40
            --set train.log_interval=10 --set model.layers.1.layers.0.dropout=0.0)
  "$carry/gpipe" "${lm[@]}" --set output.dir="$out/lm_cpu" > "$out/lm_cpu.log" 2>&1 || true
  "$carry/gpipe" "${lm[@]}" --set 'pipeline.devices=[cuda:0,cuda:0]' --set output.dir="$out/lm_gpu" \
    > "$out/lm_gpu.log" 2>&1 || true

  echo "GPU: $(tail -n 1 "$out/gpu.txt")"
  echo "CPU-vs-CUDA conformance:"
  printf '%s' "$summary"
  python3 - "$out/bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'bench':<12} {'hidden':>6} {'step ms':>9} {'GFLOP/s':>9} {'GEMM GFLOP/s':>13} {'fraction':>8}")
for r in rows:
    if r.get("error"):
        print(f"{r['bench']:<12} {r['hidden']:>6} failed")
        continue
    print(f"{r['bench']:<12} {r['hidden']:>6} {r['step_ms']:>9.2f} {r.get('achieved_gflops', float('nan')):>9.0f} "
          f"{r.get('gemm_gflops', float('nan')):>13.0f} {r.get('fraction_of_gemm_rate', float('nan')):>8.2f}")
PY
  python3 - "$out/pipeline.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'pipeline on cuda:0':<20} {'step ms':>9} {'ideal bubble':>13}")
for r in rows:
    if r.get("error"):
        print(f"K={r['k']:<18} failed")
        continue
    print(f"K={r['k']}, M={r['m']:<14} {r['step_ms']:>9.2f} {r['ideal_bubble']:>13.3f}")
PY
  echo "default LM, 40 steps, per-step loss on 2 CPU stages vs 2 stages on cuda:0:"
  paste <(grep -E '^step ' "$out/lm_cpu.log" | awk '{print $2, $4}') \
        <(grep -E '^step ' "$out/lm_gpu.log" | awk '{print $4}') || true
  grep -E 'Throughput|error' "$out/lm_cpu.log" "$out/lm_gpu.log" || true
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bench/gpu_check.sh prepare|run" >&2; exit 2 ;;
esac
