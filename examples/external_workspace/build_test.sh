#!/usr/bin/env bash
# Builds this directory, a Bazel workspace of its own that depends on gpipe, as a user
# would: each time from a fresh output base, offline (Bazel may download nothing), then
# runs its test (its layer through gpipe's gradient checker) and trains its binary.
# Twice, once per way the README shows to depend on gpipe:
#   1. local_repository (the WORKSPACE as shipped);
#   2. http_archive of this tree, packed into a tarball that Bazel finds in --distdir
#      by its sha256, as a pinned release archive would be found.
# Both builds share a disk cache (the argument, or ~/.bazelrc's), so the second
# compiles nothing. `./gpipe test` runs this after the main suite, with a fresh cache
# (bazel cannot run inside `bazel test`) and counts it in its summary.
#
#   examples/external_workspace/build_test.sh [DISK_CACHE_DIR]
set -uo pipefail
here="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpipe-external.XXXXXX")"
bases=()
cleanup() {
  for b in "${bases[@]}"; do bazel --output_base="$b" shutdown > /dev/null 2>&1; done
  chmod -R u+w "$work" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT
flags=(--symlink_prefix=/ --experimental_repository_disable_download --distdir="$work/distdir")
[ -n "${1:-}" ] && flags+=(--disk_cache="$1")
fail() { [ -n "${2:-}" ] && tail -40 "$2"; echo "FAIL: $1"; exit 1; }

# check WORKSPACE_DIR NAME: build and test //..., then train my_trainer for 20 steps.
check() {
  local dir="$1" name="$2" base="$work/base-$2" log="$work/$2.log" bin
  bases+=("$base")
  (cd "$dir" && bazel --output_base="$base" build "${flags[@]}" //... && bazel --output_base="$base" test "${flags[@]}" //...) \
    > "$log" 2>&1 || fail "$name: bazel build and test in a workspace that depends on gpipe" "$log"
  bin="$(cd "$dir" && bazel --output_base="$base" info "${flags[@]}" bazel-bin 2> /dev/null)/my_trainer"
  "$bin" train "$here/affine.yaml" --set train.steps=20 --set output.dir="$work/run-$name" > "$work/$name-run.log" 2>&1 ||
    fail "$name: my_trainer train" "$work/$name-run.log"
  grep -q '^step    20/20' "$work/$name-run.log" && [ -s "$work/run-$name/report.json" ] ||
    fail "$name: my_trainer did not finish its 20 steps with a report" "$work/$name-run.log"
  echo "ok: $name: built offline from a fresh output base, affine_test passed, my_trainer trained 20 steps"
}

copy_workspace() {  # the sources of this workspace, without its WORKSPACE
  mkdir -p "$1"
  for f in "$here"/* "$here"/.bazelrc; do
    case "$(basename "$f")" in WORKSPACE | build_test.sh | README.md | bazel-*) ;; *) cp "$f" "$1/" ;; esac
  done
}

# 1. As shipped, with gpipe at ../.. : a copy next to a link to this tree, so that the
# build leaves nothing in it.
copy_workspace "$work/local/project"
ln -s "$root" "$work/local/gpipe"
sed 's#path = "\.\./\.\."#path = "../gpipe"#' "$here/WORKSPACE" > "$work/local/project/WORKSPACE"
check "$work/local/project" local_repository

# 2. As a release archive: this tree (without build outputs) as gpipe-<version>/.
mkdir -p "$work/distdir"
tar -C "$root" --exclude='./bazel-*' --exclude=./.git --exclude=./runs --transform 's#^\.#gpipe-test#' \
  -czf "$work/distdir/gpipe-test.tar.gz" . || fail "packing this tree"
sha="$(sha256sum "$work/distdir/gpipe-test.tar.gz" | cut -d' ' -f1)"
copy_workspace "$work/archive"
cat > "$work/archive/WORKSPACE" << WS
workspace(name = "my_project")

load("@bazel_tools//tools/build_defs/repo:http.bzl", "http_archive")

http_archive(
    name = "gpipe",
    urls = ["https://gpipe.invalid/releases/gpipe-test.tar.gz"],  # never fetched: found in --distdir
    strip_prefix = "gpipe-test",
    sha256 = "$sha",
)

load("@gpipe//build_defs:deps.bzl", "gpipe_dependencies")

gpipe_dependencies()
WS
check "$work/archive" http_archive
