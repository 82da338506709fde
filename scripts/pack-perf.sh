#!/usr/bin/env bash
# Packs this machine's `perf` and the libraries it loads into
# .gpu/perf.tar.zst (about 8 MB), for the GPU hosts, which have no `perf`.
# Run after scripts/gpu-bundle.sh (it empties .gpu/). On the GPU host:
#   mkdir -p .gpu/perf && .gpu/zstd -dc .gpu/perf.tar.zst | tar -C .gpu/perf -xf -
#   LD_LIBRARY_PATH=.gpu/perf/lib .gpu/perf/perf record -F 5000 -o $OUT/perf.data \
#     -- env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" .gpu/bin/bench_nixl --small-passes 20000
# (the `env` gives the benchmark its own library path back), then
# `perf report` there too (its symbols are the host's). Used in session 44
# (book: benchmarks, "A CPU profile of 4 KiB passes on the GPU host").
set -euo pipefail
cd "$(dirname "$0")/.."
perf=$(command -v perf) || { echo "no perf on this machine (apt-get install linux-perf)" >&2; exit 1; }
[ -x .gpu/zstd ] || { echo "build the bundle first (scripts/gpu-bundle.sh)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lib"
cp "$perf" "$tmp/perf"
# Every library perf loads but glibc's own (the host has those).
ldd "$perf" | awk '/=>/ {print $3}' | grep -vE '/(libc|libm|ld-linux[^/]*)\.so' \
  | xargs -I{} cp -L {} "$tmp/lib/"
tar -C "$tmp" -cf - . | .gpu/zstd -19 -T0 -q -f -o .gpu/perf.tar.zst
ls -la .gpu/perf.tar.zst
