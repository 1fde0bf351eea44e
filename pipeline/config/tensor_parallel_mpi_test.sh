#!/usr/bin/env bash
# Runs tensor_parallel_mpi_check as tensor groups of 2 and 4 real MPI processes on this
# machine: every rank must report ok.
set -euo pipefail
bin="$1"
for np in 2 4; do
  out="$(timeout 300 mpirun --allow-run-as-root --oversubscribe -np "$np" "$bin" 2>&1)" || { echo "$out"; exit 1; }
  echo "$out"
  got="$(grep -c "tensor_parallel_mpi_check: rank [0-9] of $np ok" <<< "$out" || true)"
  [ "$got" -eq "$np" ] || { echo "expected $np ranks ok, got $got"; exit 1; }
done
