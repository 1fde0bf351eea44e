#!/usr/bin/env bash
# Other tools read gpipe's checkpoints: writes one (checkpoint_torch_fixture) and loads it
# with the safetensors Python package through bench/load_checkpoint_torch.py, which checks
# names, dtypes, shapes and values against what gpipe wrote. Reports itself skipped where
# Python or the package is missing.
#   checkpoint_torch_test.sh FIXTURE SCRIPT
set -euo pipefail
fixture="$1"
script="$2"
dir="${TEST_TMPDIR:-$(mktemp -d)}/torch_checkpoint"
rm -rf "$dir"
"$fixture" "$dir"
python=""
for p in python3 /usr/bin/python3; do
  command -v "$p" > /dev/null 2>&1 && { python="$p"; break; }
done
[ -n "$python" ] || { echo "GPIPE_TEST_SKIPPED: no python3 to run $script"; exit 0; }
"$python" "$script" "$dir/step-3" "$dir/expected.json"
