#!/usr/bin/env bash
# Installs the pinned cargo-deny from crates.io into a cache outside the
# repository (once: a few minutes cold on 2 cores, instant warm) and prints
# the path of its binary.
#
# Environment:
#   BERTH_TOOLS_CACHE   cache root (default: ${XDG_CACHE_HOME:-~/.cache}/berth-tools)
set -euo pipefail

version=0.20.2
root=${BERTH_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-tools}/cargo-deny-$version
bin="$root/bin/cargo-deny"
if [ ! -x "$bin" ]; then
  echo "tools: installing cargo-deny $version into $root" >&2
  # Into a temporary root first, so an interrupted install never leaves a
  # half-written binary where the next run would trust it.
  tmp="$root.tmp.$$"
  rm -rf "$tmp"
  cargo install --locked --quiet --root "$tmp" --version "$version" cargo-deny >&2
  mkdir -p "$root/bin"
  mv "$tmp/bin/cargo-deny" "$bin"
  rm -rf "$tmp"
fi
echo "$bin"
