#!/usr/bin/env bash
# A model built in C++ trains through gpipe's trainer, both ways it can get there:
#  1. tiny_gpt (registered model, named in YAML) trains on a text, the loss falls, and
#     report.json is written with both stages;
#  2. under mpirun -np 2 (one stage per process) it logs the same losses;
#  3. train_in_cpp (config filled in C++, model from a factory) is the same run: the
#     same losses, with one process and with two;
#  4. a mistyped model option is refused with the valid ones.
set -uo pipefail
tiny_gpt="$1"
train_in_cpp="$2"
config="$3"
tmp="${TEST_TMPDIR:-/tmp}"
mpirun=(timeout 120 mpirun --allow-run-as-root --oversubscribe)
fail() { [ -n "${2:-}" ] && cat "$2"; echo "FAIL: $1"; exit 1; }
losses() { grep -E '^step ' "$1" | awk '{print $2, $4}'; grep -E '^Validation: loss' "$1"; }
same_losses() {
  diff <(losses "$1") <(losses "$2") || fail "$3: losses differ from the single-process YAML run" "$2"
}

for i in $(seq 300); do echo "line $i: the quick brown fox jumps over the lazy dog $((i * 37 % 101))"; done > "$tmp/text.txt"
steps=20

"$tiny_gpt" train "$config" --set data.path="$tmp/text.txt" --set train.steps=$steps --set output.dir="$tmp/yaml" \
  > "$tmp/yaml.log" 2>&1 || fail "tiny_gpt train" "$tmp/yaml.log"
[ "$(losses "$tmp/yaml.log" | wc -l)" -eq 4 ] || fail "expected steps 1, 10, 20 and the validation" "$tmp/yaml.log"
first="$(grep -m1 -E '^step +1/' "$tmp/yaml.log" | awk '{print $4}')"
last="$(grep -E "^step +$steps/$steps" "$tmp/yaml.log" | awk '{print $4}')"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.8 * a) }' || fail "the loss did not fall: $first -> $last" "$tmp/yaml.log"
[ "$(grep -c '"stage":' "$tmp/yaml/report.json")" -eq 2 ] || fail "report.json without both stages" "$tmp/yaml.log"
echo "ok: tiny_gpt (model: {cpp: tiny_gpt}) trained, loss $first -> $last, report with both stages"

"${mpirun[@]}" -np 2 "$tiny_gpt" train "$config" --set data.path="$tmp/text.txt" --set train.steps=$steps \
  --set output.dir="$tmp/yaml2" > "$tmp/yaml2.log" 2>&1 || fail "mpirun -np 2 tiny_gpt train" "$tmp/yaml2.log"
same_losses "$tmp/yaml.log" "$tmp/yaml2.log" "mpirun -np 2 tiny_gpt"
[ "$(grep -c '"stage":' "$tmp/yaml2/report.json")" -eq 2 ] || fail "no report.json from mpirun" "$tmp/yaml2.log"
echo "ok: mpirun -np 2 gives the same losses and one report"

"$train_in_cpp" "$tmp/text.txt" "$tmp/cpp" $steps > "$tmp/cpp.log" 2>&1 || fail "train_in_cpp" "$tmp/cpp.log"
same_losses "$tmp/yaml.log" "$tmp/cpp.log" "train_in_cpp"
[ -s "$tmp/cpp/report.json" ] || fail "train_in_cpp wrote no report" "$tmp/cpp.log"
"${mpirun[@]}" -np 2 "$train_in_cpp" "$tmp/text.txt" "$tmp/cpp2" $steps > "$tmp/cpp2.log" 2>&1 ||
  fail "mpirun -np 2 train_in_cpp" "$tmp/cpp2.log"
same_losses "$tmp/yaml.log" "$tmp/cpp2.log" "mpirun -np 2 train_in_cpp"
echo "ok: the config filled in C++ is the same run, with one process and with two"

"$tiny_gpt" train "$config" --set model.dims=64 > "$tmp/bad.log" 2>&1
rc=$?
[ "$rc" -eq 2 ] && grep -q "model 'tiny_gpt' (at .*tiny_gpt.yaml:7:8): unknown option 'dims'; valid options: .*dim" \
  "$tmp/bad.log" || fail "a mistyped model option (rc=$rc)" "$tmp/bad.log"
echo "ok: a mistyped model option is refused with the valid ones"
