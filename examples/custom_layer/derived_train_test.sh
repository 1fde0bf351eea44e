#!/usr/bin/env bash
# my_gpipe trains a config of forward-only layers of one's own (derived.yaml: my_swiglu,
# derived_rmsnorm) under zero bubble, whose W runs their derived weight gradients: the
# loss falls, and plan shows the layers with their derived costs.
set -uo pipefail
my_gpipe="$1"
config="$2"
tmp="${TEST_TMPDIR:-/tmp}"
fail() { [ -n "${2:-}" ] && cat "$2"; echo "FAIL: $1"; exit 1; }

"$my_gpipe" plan "$config" > "$tmp/plan.log" 2>&1 || fail "my_gpipe plan" "$tmp/plan.log"
grep -q "my_swiglu(128) -> (128)" "$tmp/plan.log" || fail "plan does not show the my_swiglu layers" "$tmp/plan.log"
grep -q "derived_rmsnorm(128) -> (128)" "$tmp/plan.log" || fail "plan does not show the derived_rmsnorm layers" "$tmp/plan.log"
echo "ok: plan balances a model of derived layers"

"$my_gpipe" train "$config" --set train.steps=60 --set train.log_interval=10 --set output.dir="$tmp/run" \
  > "$tmp/train.log" 2>&1 || fail "my_gpipe train" "$tmp/train.log"
first="$(grep -m1 -E '^step +1/' "$tmp/train.log" | awk '{print $4}')"
last="$(grep -E '^step +60/60' "$tmp/train.log" | awk '{print $4}')"
[ -n "$first" ] && [ -n "$last" ] || fail "no step lines" "$tmp/train.log"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.7 * a) }' || fail "the loss did not fall: $first -> $last" "$tmp/train.log"
echo "ok: trained 60 steps on 2 stages under zero bubble, loss $first -> $last"
