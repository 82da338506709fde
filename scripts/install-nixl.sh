#!/usr/bin/env bash
# Installs NIXL's libraries for the `nixl` transport: the `nixl-cu13` wheel
# from PyPI, without its Python dependencies, into a folder of its own
# (default: ~/.cache/rdt/nixl-cu13-<release>, where rdt looks by itself;
# or $1, or $RDT_NIXL_DIR). The wheel carries libnixl_capi.so, the UCX
# plugin and a private UCX; it needs no CUDA to run on the CPU.
set -euo pipefail
release=1.5.1 # keep in step with transports/src/nixl/api.rs (PINNED_RELEASE)
dir="${1:-${RDT_NIXL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rdt/nixl-cu13-$release}}"
lib="$dir/.nixl_cu13.mesonpy.libs/libnixl_capi.so"
if [ -f "$lib" ]; then
  echo "NIXL $release is in $dir"
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "installing pip (Debian's python3-pip) to fetch NIXL" >&2
  apt-get update -qq && apt-get install -y -qq python3-pip >/dev/null
fi
tmp="$dir.partial"
rm -rf "$tmp"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
  --target "$tmp" "nixl-cu13==$release"
# The expert-parallel kernels (nixl_ep_cu13, ~90 MB) are never loaded by rdt.
rm -rf "$tmp/nixl_ep_cu13"
rm -rf "$dir"
mv "$tmp" "$dir"
test -f "$lib" || { echo "the nixl-cu13 wheel has no $lib" >&2; exit 1; }
echo "NIXL $release installed in $dir"
