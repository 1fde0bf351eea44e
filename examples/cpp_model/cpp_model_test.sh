#!/usr/bin/env bash
# A model built in C++ trains through gpipe's trainer, both ways it can get there:
#  1. tiny_gpt (registered model, named in YAML) trains on a text, the loss falls, and
#     report.json is written with both stages;
#  2. under mpirun -np 2 (one stage per process) it logs the same losses;
#  3. train_in_cpp (config filled in C++, model from a factory) is the same run: the
#     same losses, with one process and with two;
#  4. a mistyped model option is refused with the valid ones;
#  5. its checkpoints name the tensors by the model's own layer names (GPT-2's: wte,
#     h.0, ln_f; the head tied to wte saved once), and a run resumed from one under
#     mpirun -np 2 ends with the same loss.
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
[ "$rc" -eq 2 ] && grep -q "model 'tiny_gpt' (at .*tiny_gpt.yaml:7:8): unknown option 'dims'; did you mean dim? valid options: .*dim" \
  "$tmp/bad.log" || fail "a mistyped model option (rc=$rc)" "$tmp/bad.log"
echo "ok: a mistyped model option is refused with the valid ones"

# 5. Checkpoints by the model's own names; resume on two processes.
index="$tmp/yaml/checkpoints/step-20/model.safetensors.index.json"
[ -e "$tmp/yaml/checkpoints/step-20/COMPLETE" ] || fail "no checkpoint at step 20" "$tmp/yaml.log"
for name in wte.token h.0.attn.qkv.weight h.1.fc2.bias ln_f.weight; do
  grep -q "\"$name\"" "$index" || fail "the checkpoint has no $name" "$index"
done
! grep -q '"lm_head.weight"' "$index" || fail "the tied head is saved twice" "$index"
"${mpirun[@]}" -np 2 "$tiny_gpt" train "$config" --set data.path="$tmp/text.txt" --set train.steps=$steps \
  --set output.dir="$tmp/resumed" --set checkpoint.resume="$tmp/yaml/checkpoints/step-10" > "$tmp/resumed.log" 2>&1 ||
  fail "resume under mpirun -np 2" "$tmp/resumed.log"
diff <(grep -E "^step +$steps/" "$tmp/yaml.log" | awk '{print $4}') \
     <(grep -E "^step +$steps/" "$tmp/resumed.log" | awk '{print $4}') || fail "the resumed run's last loss differs" "$tmp/resumed.log"
echo "ok: checkpoints named wte, h.N, ln_f; resumed from step 10 on two processes to the same loss"
