#!/usr/bin/env bash
# Measures that the tests can fail: applies each deliberate bug listed in tests/mutants.txt,
# one at a time, to a scratch copy of this tree, runs the test targets named for it and says
# whether a test noticed (killed) or not (SURVIVED). Not part of ./gpipe test (see TESTING.md).
#
#   tests/mutants.sh               every mutant, one after another
#   tests/mutants.sh NAME ...      only these mutants
#   tests/mutants.sh --list        the table: name, file, tests
#   tests/mutants.sh --check       only check that every mutant applies (no build)
#   tests/mutants.sh --clean       also delete the scratch copy's Bazel output base at the end
#
# The scratch copy is $GPIPE_MUTANTS_DIR (default ~/.cache/gpipe-mutants; not under
# /dev/shm, which .bazelrc hides from test sandboxes behind a tmpfs): the
# tracked and untracked-but-not-ignored files of this tree, as they are now, uncommitted
# edits included. The real tree is never edited. Bazel uses the --disk_cache of ~/.bazelrc,
# so unchanged targets come from the cache; the scratch copy keeps its own output base
# between runs (delete it with --clean), and its Bazel server is shut down at the end.
#
# Exit status: 0 when every mutant was killed; 1 when one survived, could not be applied
# (its text is missing or not unique) or did not build; 2 for a usage error, a malformed
# table, or a baseline (the unmutated copy) that fails the tests.
set -uo pipefail

root="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
table="$root/tests/mutants.txt"
work="${GPIPE_MUTANTS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gpipe-mutants}"
tree="$work/tree"
logs="$work/logs"

die() { printf 'mutants: %s\n' "$*" >&2; exit 2; }

# ---- The table: blocks of "key value" lines, a blank line between mutants.
names=() files=() finds=() repls=() targets=() abouts=()
read_table() {
  [ -r "$table" ] || die "cannot read $table"
  local line key value lineno=0 n=-1
  local -A seen=()
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    [[ "$line" =~ ^[[:space:]]*# ]] && continue
    [[ "$line" =~ ^[[:space:]]*$ ]] && continue
    key="${line%%[[:space:]]*}"
    value="${line#"$key"}"
    value="${value#"${value%%[![:space:]]*}"}"   # the spaces after the key
    value="${value%"${value##*[![:space:]]}"}"   # trailing spaces
    case "$key" in
      mutant)
        [ -n "$value" ] || die "$table:$lineno: a mutant needs a name"
        [ -z "${seen[$value]:-}" ] || die "$table:$lineno: mutant '$value' is listed twice"
        seen[$value]=1
        n=$((n + 1))
        names[n]="$value" files[n]="" finds[n]="" repls[n]="" targets[n]="" abouts[n]=""
        ;;
      about|file|find|replace|tests)
        [ "$n" -ge 0 ] || die "$table:$lineno: '$key' before the first 'mutant' line"
        case "$key" in
          about) abouts[n]="$value" ;;
          file) files[n]="$value" ;;
          find) finds[n]="$value" ;;
          replace) repls[n]="$value" ;;
          tests) targets[n]="$value" ;;
        esac
        ;;
      *) die "$table:$lineno: unknown key '$key' (use mutant, about, file, find, replace, tests)" ;;
    esac
  done < "$table"
  local i
  for i in "${!names[@]}"; do
    [ -n "${files[i]}" ] || die "mutant ${names[i]}: no 'file' line"
    [ -n "${finds[i]}" ] || die "mutant ${names[i]}: no 'find' line"
    [ -n "${targets[i]}" ] || die "mutant ${names[i]}: no 'tests' line"
    [ "${finds[i]}" != "${repls[i]}" ] || die "mutant ${names[i]}: 'replace' equals 'find'"
  done
  [ "${#names[@]}" -gt 0 ] || die "$table lists no mutant"
}

# Replaces the one occurrence of FIND in FILE; exit 3 with the count when it is not one.
apply_mutant() {  # file find replace
  python3 - "$@" <<'PY'
import sys
path, find, repl = sys.argv[1:4]
with open(path, encoding="utf-8") as f:
    text = f.read()
n = text.count(find)
if n != 1:
    print(n)
    sys.exit(3)
with open(path, "w", encoding="utf-8") as f:
    f.write(text.replace(find, repl, 1))
PY
}

# ---- Arguments.
list=0 check_only=0 clean=0 wanted=()
for a in "$@"; do
  case "$a" in
    --list) list=1 ;;
    --check) check_only=1 ;;
    --clean) clean=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) die "unknown option '$a' (see --help)" ;;
    *) wanted+=("$a") ;;
  esac
done
read_table
if [ "$list" -eq 1 ]; then
  for i in "${!names[@]}"; do printf '%-32s %-34s %s\n' "${names[i]}" "${files[i]}" "${targets[i]}"; done
  exit 0
fi
selected=()
if [ "${#wanted[@]}" -eq 0 ]; then
  selected=("${!names[@]}")
else
  for w in "${wanted[@]}"; do
    found=""
    for i in "${!names[@]}"; do [ "${names[i]}" = "$w" ] && found="$i"; done
    [ -n "$found" ] || die "no mutant named '$w' in $table (see --list)"
    selected+=("$found")
  done
fi

# ---- The scratch copy, one run at a time.
mkdir -p "$work" || die "cannot create $work"
exec 9> "$work/lock"
flock -n 9 || die "another mutation run is using $work (set GPIPE_MUTANTS_DIR to run elsewhere)"
case "$work/" in
  "$root"/*) die "the scratch folder $work lies inside the tree; set GPIPE_MUTANTS_DIR elsewhere" ;;
  /dev/shm/*) die "the scratch folder $work is under /dev/shm, which test sandboxes hide (.bazelrc); set GPIPE_MUTANTS_DIR elsewhere" ;;
esac
command -v git > /dev/null || die "git is needed to list the tree's files"
command -v python3 > /dev/null || die "python3 is needed to apply the mutants"
rm -rf "$tree" "$logs" && mkdir -p "$tree" "$logs" || die "cannot prepare $tree"
(cd "$root" && git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi; done |
  tar --null --no-recursion -T - -cf -) | tar -C "$tree" -xf - || die "cannot copy the tree to $tree"

# Which mutants apply: each text must occur exactly once in its file.
declare -A status=()
not_applied=0
for i in "${selected[@]}"; do
  f="$tree/${files[i]}"
  if [ ! -f "$f" ]; then
    status[$i]="NOT APPLIED: ${files[i]} does not exist"
  else
    cp "$f" "$work/pristine"
    count="$(apply_mutant "$f" "${finds[i]}" "${repls[i]}")"
    rc=$?
    cp "$work/pristine" "$f"
    if [ "$rc" -eq 3 ]; then
      status[$i]="NOT APPLIED: its text occurs $count times in ${files[i]}, not once"
    elif [ "$rc" -ne 0 ]; then
      status[$i]="NOT APPLIED: could not edit ${files[i]}"
    fi
  fi
  if [ -n "${status[$i]:-}" ]; then
    not_applied=$((not_applied + 1))
    printf '%-32s %s\n' "${names[i]}" "${status[$i]}"
  fi
done
if [ "$check_only" -eq 1 ]; then
  echo "${#selected[@]} mutants checked, $not_applied not applicable"
  [ "$not_applied" -eq 0 ]
  exit $?
fi

# ---- Bazel in the scratch copy.
disk_cache="$(sed -n 's/^[[:space:]]*\(build\|test\|common\)[[:space:]].*--disk_cache=\([^[:space:]]*\).*/\2/p' \
  "$HOME/.bazelrc" 2> /dev/null | tail -1)"
bazel_flags=(--color=no --curses=no --test_output=errors --test_summary=short)
[ -n "$disk_cache" ] && bazel_flags+=("--disk_cache=$disk_cache")
cleanup() {
  [ -n "${mutated:-}" ] && cp "$work/pristine" "$mutated"
  (cd "$tree" && if [ "$clean" -eq 1 ]; then bazel clean --expunge; else bazel shutdown; fi) > /dev/null 2>&1
}
trap cleanup EXIT
trap 'exit 130' INT TERM

run_tests() {  # log, targets...
  local log="$1"
  shift
  (cd "$tree" && bazel test "${bazel_flags[@]}" "$@") > "$log" 2>&1
}

# The failed targets of a log, each with its first failing test case or FAIL line.
failures() {  # log
  local t out="" why testlog
  while read -r t; do
    testlog="$tree/bazel-testlogs/${t#//}"
    testlog="${testlog/://}/test.log"
    why=""
    # The test case of the first ERROR (a case that only warned printed its header too), or a FAIL line.
    [ -f "$testlog" ] && why="$(awk '/^TEST CASE:/ { c = $0; sub(/^TEST CASE:[[:space:]]*/, "", c) }
                                      / ERROR: / && c != "" { print c; exit }
                                      /FAIL:/ { sub(/^.*FAIL:[[:space:]]*/, ""); print; exit }' "$testlog")"
    grep -qE "^$t[[:space:]].*TIMEOUT" "$1" && why="timed out${why:+; $why}"
    out+="${out:+; }$t${why:+ (${why:0:100})}"
  done < <(grep -E '^//[^[:space:]]+[[:space:]].*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$1" | awk '{print $1}' | sort -u)
  echo "$out"
}

fmt_time() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

start=$SECONDS
all_targets=()
for i in "${selected[@]}"; do [ -z "${status[$i]:-}" ] && all_targets+=(${targets[i]}); done
if [ "${#all_targets[@]}" -gt 0 ]; then
  mapfile -t all_targets < <(printf '%s\n' "${all_targets[@]}" | sort -u)
  echo "baseline: the unmutated copy against ${#all_targets[@]} test targets ($tree)"
  if ! run_tests "$logs/baseline.log" "${all_targets[@]}"; then
    echo "baseline FAILED: $(failures "$logs/baseline.log")"
    tail -20 "$logs/baseline.log"
    die "the unmutated tree fails its tests (log: $logs/baseline.log); fix that first"
  fi
  echo "baseline passes ($(fmt_time $((SECONDS - start))))"
fi

killed=0 survived=0 broken=0 total=${#selected[@]} index=0
for i in "${selected[@]}"; do
  index=$((index + 1))
  name="${names[i]}"
  label="$(printf '[%2d/%d] %-32s' "$index" "$total" "$name")"
  if [ -n "${status[$i]:-}" ]; then
    echo "$label ${status[$i]}"
    continue
  fi
  t0=$SECONDS
  mutated="$tree/${files[i]}"
  cp "$mutated" "$work/pristine"
  apply_mutant "$mutated" "${finds[i]}" "${repls[i]}" > /dev/null || die "could not apply $name after checking it"
  log="$logs/$name.log"
  run_tests "$log" ${targets[i]}
  rc=$?
  cp "$work/pristine" "$mutated"
  mutated=""
  took="$(fmt_time $((SECONDS - t0)))"
  case "$rc" in
    0) survived=$((survived + 1)); result="SURVIVED ${targets[i]}" ;;
    3) killed=$((killed + 1)); result="killed   $(failures "$log")" ;;
    1) broken=$((broken + 1)); result="DID NOT BUILD (log: $log)" ;;
    *) broken=$((broken + 1)); result="bazel exited $rc (log: $log)" ;;
  esac
  echo "$label $took  $result"
done

elapsed=$((SECONDS - start))
echo "$total mutants: $killed killed, $survived survived, $not_applied not applied, $broken did not build or run;" \
  "$(fmt_time "$elapsed") on $(nproc) cores; logs in $logs"
[ "$killed" -eq "$total" ]
