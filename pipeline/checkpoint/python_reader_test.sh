#!/usr/bin/env bash
# Code outside gpipe reads gpipe's checkpoints: FIXTURE writes one into a fresh directory,
# with what gpipe computed beside it (EXPECTED), and the Python SCRIPT reads the checkpoint
# step STEP and checks it against that. Reports itself skipped without python3 (the script
# itself reports a missing package the same way). The python3 is $GPIPE_PYTHON where that
# is set (`./gpipe test` sets it to the environment it installs the packages into), else
# the first on PATH.
#   checkpoint_torch_test:  bench/load_checkpoint_torch.py, the safetensors package: names,
#                           dtypes, shapes and values;
#   llama_reference_test:   bench/llama_reference.py, a LLaMA written from its definitions
#                           in plain Python: the logits and the loss.
#   python_reader_test.sh FIXTURE SCRIPT STEP EXPECTED
set -euo pipefail
fixture="$1"
script="$2"
step="$3"
expected="$4"
dir="${TEST_TMPDIR:-$(mktemp -d)}/checkpoint"
rm -rf "$dir"
"$fixture" "$dir"
python=""
for p in ${GPIPE_PYTHON:+"$GPIPE_PYTHON"} python3 /usr/bin/python3; do
  command -v "$p" > /dev/null 2>&1 && { python="$p"; break; }
done
[ -n "$python" ] || { echo "GPIPE_TEST_SKIPPED: no python3 to run $script (./gpipe test installs one)"; exit 0; }
"$python" "$script" "$dir/$step" "$dir/$expected"
