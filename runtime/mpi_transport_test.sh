#!/usr/bin/env bash
# Runs mpi_transport_check on two MPI ranks; both must report ok.
set -euo pipefail
bin="$1"
out="$(timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" 2>&1)" || { echo "$out"; exit 1; }
echo "$out"
[ "$(grep -c 'mpi_transport_check: rank [01] ok' <<< "$out")" -eq 2 ]
