#!/usr/bin/env bash
# A gpipe checkpoint of a tiny LLaMA-style model reproduces gpipe's logits and loss in an
# implementation written without gpipe: llama_reference_fixture saves the model and what
# it computed, bench/llama_reference.py reads the safetensors files with the standard
# library and runs LLaMA from its definitions. Reports itself skipped without python3.
#   llama_reference_test.sh FIXTURE SCRIPT
set -euo pipefail
fixture="$1"
script="$2"
dir="${TEST_TMPDIR:-$(mktemp -d)}/llama_checkpoint"
rm -rf "$dir"
"$fixture" "$dir"
python=""
for p in python3 /usr/bin/python3; do
  command -v "$p" > /dev/null 2>&1 && { python="$p"; break; }
done
[ -n "$python" ] || { echo "GPIPE_TEST_SKIPPED: no python3 to run $script"; exit 0; }
"$python" "$script" "$dir/step-1" "$dir/llama_expected.json"
