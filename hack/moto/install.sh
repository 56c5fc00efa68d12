#!/usr/bin/env bash
# Installs moto's server (the EC2 emulator the aws provider is tested
# against) from the pinned requirements beside this script into a
# virtualenv cached outside the repository, and prints its bin directory.
#
#   hack/moto/install.sh              install what is missing, say so
#   hack/moto/install.sh --bin-dir    same, quietly; print only the bin dir
#
# The cache key is a hash of the requirements, this script and the Python
# version, so a change to any pin installs into a new directory. An
# interrupted install is started again from nothing on the next run.
#
# Environment:
#   BERTH_MOTO_CACHE   cache root (default: ${XDG_CACHE_HOME:-~/.cache}/berth-moto)
#   BERTH_PYTHON       the Python to build it with (default: python3, >= 3.9)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
quiet=0
case "${1:-}" in
  --bin-dir) quiet=1 ;;
  "") ;;
  *) echo "usage: $0 [--bin-dir]" >&2; exit 2 ;;
esac
say() { [ "$quiet" = 1 ] || echo "moto: $*" >&2; }

python=${BERTH_PYTHON:-python3}
command -v "$python" >/dev/null || { echo "moto: FAILED: $python is not on PATH" >&2; exit 1; }
key=$( { cat "$here/requirements.txt" "$0"; "$python" --version; } | sha256sum | cut -c1-12)
root=${BERTH_MOTO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-moto}
venv="$root/moto-$key"
# A virtualenv's scripts name its interpreter by absolute path, so it is
# built where it lives; a marker written last says that pip finished. Test
# binaries run side by side (docs/testing.md) may ask at once: one installs
# under the lock while the others wait for it, then find the marker.
mkdir -p "$root"
exec 9>"$root/.install.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  say "installing moto into $venv (about a minute)"
  rm -rf "$venv"
  mkdir -p "$root"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt" >&2
  touch "$venv/.complete"
fi
say "ready: $venv/bin"
[ "$quiet" = 1 ] && echo "$venv/bin"
exit 0
