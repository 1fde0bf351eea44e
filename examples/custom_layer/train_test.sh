#!/usr/bin/env bash
# my_gpipe, gpipe's command line plus RMSNorm, trains a config that uses the new type:
# the loss falls over a short run, the report is written, plan and help know the type,
# and a mistyped option of it is an error naming the option.
set -uo pipefail
my_gpipe="$1"
config="$2"
tmp="${TEST_TMPDIR:-/tmp}"
fail() { [ -n "${2:-}" ] && cat "$2"; echo "FAIL: $1"; exit 1; }

"$my_gpipe" help > "$tmp/help.log" 2>&1 || fail "my_gpipe help" "$tmp/help.log"
grep -q "^layer types: .*my_rmsnorm" "$tmp/help.log" || fail "help does not list my_rmsnorm" "$tmp/help.log"
"$my_gpipe" plan "$config" > "$tmp/plan.log" 2>&1 || fail "my_gpipe plan" "$tmp/plan.log"
grep -q "my_rmsnorm(128)" "$tmp/plan.log" || fail "plan does not show the my_rmsnorm layers" "$tmp/plan.log"
echo "ok: help lists my_rmsnorm and plan balances a model with it"

"$my_gpipe" train "$config" --set train.steps=60 --set train.log_interval=10 --set output.dir="$tmp/run" \
  > "$tmp/train.log" 2>&1 || fail "my_gpipe train" "$tmp/train.log"
first="$(grep -m1 -E '^step +1/' "$tmp/train.log" | awk '{print $4}')"
last="$(grep -E '^step +60/60' "$tmp/train.log" | awk '{print $4}')"
[ -n "$first" ] && [ -n "$last" ] || fail "no step lines" "$tmp/train.log"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.7 * a) }' || fail "the loss did not fall: $first -> $last" "$tmp/train.log"
[ -s "$tmp/run/report.json" ] || fail "no report.json" "$tmp/train.log"
echo "ok: trained 60 steps on 2 stages, loss $first -> $last, report written"

"$my_gpipe" train "$config" --set model.layers.1.epz=1 > "$tmp/bad.log" 2>&1
rc=$?
[ "$rc" -eq 2 ] && grep -q "layer 'my_rmsnorm' (at --set model.layers.1.epz=1): unknown option 'epz'; did you mean eps? valid options: eps" "$tmp/bad.log" || fail "a mistyped rmsnorm option (rc=$rc)" "$tmp/bad.log"
echo "ok: a mistyped rmsnorm option is refused with the valid ones"
