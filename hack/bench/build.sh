#!/usr/bin/env bash
# Builds the benchmark's peer drivers from the pinned Go modules beside this
# script and caches the binaries outside the repository, next to the test bed.
#
#   hack/bench/build.sh              build what is missing, print progress
#   hack/bench/build.sh --bin-dir    same, quietly; print only the bin dir
#
# Binaries:
#   mcm-drain   Gardener machine-controller-manager's drain (hack/bench/mcm)
#
# The cache key is a hash of every go.mod/go.sum/*.go here, this script and the
# Go version, so a change to any pin or to the driver's source builds into a
# new directory and never mixes binaries of two versions. Each binary is linked
# to a temporary name in the cache and renamed into place only when the link
# succeeded, so an interrupted build never leaves a half-written binary behind.
#
# Environment:
#   BERTH_TESTBED_CACHE   cache root (default: ${XDG_CACHE_HOME:-~/.cache}/berth-testbed)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
quiet=0
case "${1:-}" in
  --bin-dir) quiet=1 ;;
  "") ;;
  *) echo "usage: $0 [--bin-dir]" >&2; exit 2 ;;
esac

say() { [ "$quiet" = 1 ] || echo "bench: $(date +%H:%M:%S) $*" >&2; }
fail() { echo "bench: FAILED: $*" >&2; exit 1; }

command -v go >/dev/null || fail "go is not on PATH (Go >= 1.26.2 is needed to build the benchmark peers)"

# The MCM version is read from the pin, so the directory name cannot drift from it.
mcm_version=$(awk '($1=="require" && $2=="github.com/gardener/machine-controller-manager"){print $3} ($1=="github.com/gardener/machine-controller-manager"){print $2}' "$here/mcm/go.mod" | head -n1)
[ -n "$mcm_version" ] || fail "cannot read the machine-controller-manager pin from $here/mcm/go.mod"

key=$( { cat "$here"/*/go.mod "$here"/*/go.sum "$here"/*/*.go "$0"; go env GOVERSION; } | sha256sum | cut -c1-12)
cache_root=${BERTH_TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-testbed}
bin_dir="$cache_root/bench-mcm-$mcm_version-$key/bin"
mkdir -p "$bin_dir" || fail "cannot create $bin_dir"

# name|module dir|package
targets=(
  "mcm-drain|mcm|."
)

tmp_files=()
cleanup() { for f in "${tmp_files[@]}"; do rm -f "$f"; done; }
trap cleanup EXIT

# go.sum is committed, so the checksum database (not reachable from every
# machine) is never consulted; -mod=readonly refuses any silent re-resolution.
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -trimpath -buildvcs=false" GOSUMDB=off GOTOOLCHAIN=local

missing=()
for t in "${targets[@]}"; do
  name=${t%%|*}
  [ -x "$bin_dir/$name" ] || missing+=("$t")
done
if [ ${#missing[@]} -eq 0 ]; then
  say "all ${#targets[@]} binaries cached in $bin_dir"
  [ "$quiet" = 1 ] && echo "$bin_dir"
  exit 0
fi

say "building ${#missing[@]} of ${#targets[@]} binaries (machine-controller-manager $mcm_version) into $bin_dir"
started=$SECONDS
for t in "${missing[@]}"; do
  IFS='|' read -r name mod pkg <<<"$t"
  tmp="$bin_dir/.$name.tmp.$$"
  tmp_files+=("$tmp")
  t0=$SECONDS
  say "downloading modules for $mod"
  (cd "$here/$mod" && go mod download) || fail "go mod download in hack/bench/$mod"
  say "building $name (hack/bench/$mod)"
  if ! (cd "$here/$mod" && go build -ldflags "-s -w" -o "$tmp" "$pkg"); then
    fail "go build of $name in hack/bench/$mod"
  fi
  mv -f "$tmp" "$bin_dir/$name"
  say "built $name in $((SECONDS - t0))s"
done

"$bin_dir/mcm-drain" -h >/dev/null 2>&1 || fail "the built mcm-drain does not run"
say "bench peers ready in $((SECONDS - started))s: $bin_dir"
[ "$quiet" = 1 ] && echo "$bin_dir"
exit 0
