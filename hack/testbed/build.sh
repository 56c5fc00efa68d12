#!/usr/bin/env bash
# Builds berth's test control plane from the pinned Go modules beside this
# script and caches the binaries outside the repository.
#
#   hack/testbed/build.sh              build what is missing, print progress
#   hack/testbed/build.sh --bin-dir    same, quietly; print only the bin dir
#
# The cache key is a hash of every go.mod/go.sum here, this script and the Go
# version, so a change to any pin builds into a new directory and never mixes
# binaries of two versions. Each binary is linked to a temporary name in the
# cache and renamed into place only when the link succeeded, so an
# interrupted build never leaves a half-written binary behind.
#
# Environment:
#   BERTH_TESTBED_CACHE   cache root (default: ${XDG_CACHE_HOME:-~/.cache}/berth-testbed)
#   BERTH_TESTBED_JOBS    parallel Go builds (default 1: a kube link takes ~2 GiB)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
quiet=0
case "${1:-}" in
  --bin-dir) quiet=1 ;;
  "") ;;
  *) echo "usage: $0 [--bin-dir]" >&2; exit 2 ;;
esac

say() { [ "$quiet" = 1 ] || echo "testbed: $(date +%H:%M:%S) $*" >&2; }
fail() { echo "testbed: FAILED: $*" >&2; exit 1; }

command -v go >/dev/null || fail "go is not on PATH (Go >= 1.26 is needed to build the test bed)"

# The Kubernetes version is read from the pin, so the stamp cannot drift from it.
kube_version=$(awk '$1=="k8s.io/kubernetes"{print $2}' "$here/kube/go.mod")
[ -n "$kube_version" ] || fail "cannot read the k8s.io/kubernetes pin from $here/kube/go.mod"
kwok_version=$(awk '$1=="require" && $2=="sigs.k8s.io/kwok"{print $3}' "$here/kwok/go.mod")
[ -n "$kwok_version" ] || fail "cannot read the sigs.k8s.io/kwok pin from $here/kwok/go.mod"

key=$( { cat "$here"/*/go.mod "$here"/*/go.sum "$0"; go env GOVERSION; } | sha256sum | cut -c1-12)
cache_root=${BERTH_TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-testbed}
bin_dir="$cache_root/kube-$kube_version-$key/bin"
mkdir -p "$bin_dir" || fail "cannot create $bin_dir"

# name|module dir|package|ldflags
major=${kube_version#v}; major=${major%%.*}
minor=${kube_version#v*.}; minor=${minor%%.*}
kube_stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_stamp+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  kube_stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
kwok_stamp="-X sigs.k8s.io/kwok/pkg/consts.Version=${kwok_version#v}"
targets=(
  "etcd|kube|go.etcd.io/etcd/server/v3|"
  "kube-apiserver|kube|k8s.io/kubernetes/cmd/kube-apiserver|$kube_stamp"
  "kube-controller-manager|kube|k8s.io/kubernetes/cmd/kube-controller-manager|$kube_stamp"
  "kube-scheduler|kube|k8s.io/kubernetes/cmd/kube-scheduler|$kube_stamp"
  "kubectl|kube|k8s.io/kubernetes/cmd/kubectl|$kube_stamp"
  "kwok|kwok|sigs.k8s.io/kwok/cmd/kwok|$kwok_stamp"
  "kwokctl|kwok|sigs.k8s.io/kwok/cmd/kwokctl|$kwok_stamp"
  "helm|helm|helm.sh/helm/v3/cmd/helm|"
  "kubeconform|helm|github.com/yannh/kubeconform/cmd/kubeconform|"
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

say "building ${#missing[@]} of ${#targets[@]} binaries ($kube_version, kwok $kwok_version) into $bin_dir"
started=$SECONDS
for mod in kube kwok helm; do
  say "downloading modules for $mod"
  (cd "$here/$mod" && go mod download) || fail "go mod download in hack/testbed/$mod"
done

build_one() {
  local name=$1 mod=$2 pkg=$3 ldflags=$4
  local tmp="$bin_dir/.$name.tmp.$$"
  local t0=$SECONDS
  say "building $name ($pkg)"
  if ! (cd "$here/$mod" && go build -ldflags "-s -w $ldflags" -o "$tmp" "$pkg"); then
    rm -f "$tmp"
    fail "go build of $name ($pkg) in hack/testbed/$mod"
  fi
  mv -f "$tmp" "$bin_dir/$name"
  say "built $name in $((SECONDS - t0))s"
}

jobs=${BERTH_TESTBED_JOBS:-1}
pids=()
for t in "${missing[@]}"; do
  IFS='|' read -r name mod pkg ldflags <<<"$t"
  tmp_files+=("$bin_dir/.$name.tmp.$$")
  if [ "$jobs" -le 1 ]; then
    build_one "$name" "$mod" "$pkg" "$ldflags"
  else
    build_one "$name" "$mod" "$pkg" "$ldflags" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$jobs" ]; then
      wait "${pids[0]}" || fail "a parallel build failed (see above)"
      pids=("${pids[@]:1}")
    fi
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail "a parallel build failed (see above)"; done

"$bin_dir/kube-apiserver" --version >&2 || fail "the built kube-apiserver does not run"
say "test bed ready in $((SECONDS - started))s: $bin_dir"
[ "$quiet" = 1 ] && echo "$bin_dir"
exit 0
