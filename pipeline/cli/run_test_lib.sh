# Shared by the shell tests of a run's integrity and ownership (sourced, not run): the small
# float64 MLP both train, and how they judge a command.

fail() { echo "FAIL: $*"; exit 1; }

expect() {  # want, log, rc, message...: the exit status, and every message in the log
  local want="$1" log="$2" rc="$3"; shift 3
  [ "$rc" -eq "$want" ] || { cat "$log"; fail "$log: exit $rc, want $want"; }
  for m in "$@"; do grep -qF -- "$m" "$log" || { cat "$log"; fail "$log lacks: $m"; }; done
}

write_mlp_yaml() {  # file, train.steps, train.log_interval, more top-level YAML lines...
  local file="$1" steps="$2" log_interval="$3"; shift 3
  {
    cat <<YAML
model:
  input: [16]
  dtype: float64
  layers:
    - {type: linear, out: 32}
    - {type: relu}
    - {type: linear, out: 32}
    - {type: relu}
    - {type: linear, out: 4}
  loss: {type: softmax_cross_entropy}
data: {classes: 4, eval_samples: 64}
pipeline: {partitions: 2, micro_batches: 2}
optimizer: {type: adam, lr: 0.01}
train: {steps: $steps, batch_size: 16, log_interval: $log_interval}
YAML
    local line
    for line in "$@"; do echo "$line"; done
  } > "$file"
}
