#!/usr/bin/env bash
# Builds the quickstart, the `gpu` integration tests, the weight-sync example and the CUDA, NCCL, NIXL and weight-sync benchmarks in release mode
# into .gpu/ (self-contained: no Rust toolchain or network needed where it
# runs), with .gpu/run.sh to run them all on a GPU host.
#   scripts/gpu-bundle.sh            # build the bundle
#   bash .gpu/run.sh [LOGDIR]        # on the GPU host; logs + bench JSON in LOGDIR (default .gpu/out)
# libcuda is found by the binaries themselves; run.sh looks for NVRTC and
# cuRAND in the usual places (and RDT_CUDA_LIB_DIRS) when the loader does
# not know them; set LD_LIBRARY_PATH for anything else.
# The two-GPU tests are #[ignore]d: run.sh runs them (--ignored) when it
# sees two GPUs, and counts them as skipped otherwise. RDT_EXPECT_GPUS=2
# makes them mandatory: fewer GPUs is then a failure. run.sh ends with
#   gpu tests: N passed, M failed, K skipped
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu
rm -rf "$out"
mkdir -p "$out/bin"
ex="$(git rev-parse --git-path info/exclude)"; mkdir -p "$(dirname "$ex")"; grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >> "$ex"

cargo test -p rdt-integration-tests --features gpu --release --no-run --message-format=json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])
' > "$out/tests.txt"
cargo build -p rdt-examples --release --example bench_cuda --example bench_nccl --example bench_nixl --example quickstart --example bench --example interop_candle --example interop_cudarc --example weight_sync
# Cargo's target folder (CARGO_TARGET_DIR where it is set).
tgt="${CARGO_TARGET_DIR:-target}"
while read -r exe; do cp "$exe" "$out/bin/gpu-tests"; done < "$out/tests.txt"
cp "$tgt/release/examples/bench_cuda" "$out/bin/bench_cuda"
cp "$tgt/release/examples/bench_nccl" "$out/bin/bench_nccl"
cp "$tgt/release/examples/bench_nixl" "$out/bin/bench_nixl"
cp "$tgt/release/examples/quickstart" "$out/bin/quickstart"
cp "$tgt/release/examples/bench" "$out/bin/bench"
cp "$tgt/release/examples/interop_candle" "$out/bin/interop_candle"
cp "$tgt/release/examples/interop_cudarc" "$out/bin/interop_cudarc"
cp "$tgt/release/examples/weight_sync" "$out/bin/weight_sync"
rm "$out/tests.txt"
# The commit the bundle was built from (with -dirty for uncommitted
# changes), recorded by the benchmark in every row.
commit="$(git rev-parse --short HEAD)"
git diff --quiet HEAD -- . ':!book' 2>/dev/null || commit="$commit-dirty"
echo "$commit" > "$out/COMMIT"
# Unstripped copies stay here, to resolve addresses of a crash report.
mkdir -p "$tgt/gpu-unstripped"
cp "$out/bin/"* "$tgt/gpu-unstripped/"

# NIXL (the nixl transport): what libnixl_capi.so, the UCX plugin and
# UCX's transport modules load, out of the nixl-cu13 wheel, as a tar.zst
# (about 20 MB), with this machine's zstd to unpack it (the GPU image has
# none). run.sh unpacks it and points RDT_NIXL_DIR at it.
nixl_src="$(scripts/install-nixl.sh | sed -n 's/^NIXL .* in //p; s/^NIXL .* installed in //p' | tail -n1)"
stage="$(mktemp -d)"
mkdir -p "$stage/nixl"
(
  cd "$nixl_src"
  roots=(.nixl_cu13.mesonpy.libs/libnixl_capi.so .nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so)
  for m in nixl_cu13.libs/ucx/lib*.so.0.0.0; do
    case "$m" in *perftest*) ;; *) roots+=("$m");; esac
  done
  {
    printf '%s\n' "${roots[@]}"
    LD_LIBRARY_PATH= ldd "${roots[@]}" 2>/dev/null | awk '$3 ~ /^\// {print $3}' \
      | while read -r f; do realpath --relative-to=. "$f"; done | grep -v '^\.\./'
  } | sort -u | while read -r f; do cp --parents "$f" "$stage/nixl/"; done
)
tar -C "$stage" -cf - nixl | zstd -19 -T0 -q -o "$out/nixl.tar.zst"
cp "$(command -v zstd)" "$out/zstd"
rm -rf "$stage"

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the rdt GPU bundle: the quickstart, the gpu tests (the two-GPU ones
# where two GPUs are visible), the CUDA and NCCL benchmarks, then the
# control-plane benchmark; ends with the line `gpu tests: N passed, M failed, K skipped`.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
logs="${1:-$here/out}"
mkdir -p "$logs"
export NCCL_NVLS_ENABLE=0
export RUST_BACKTRACE=1
export RDT_COMMIT="$(cat "$here/COMMIT" 2>/dev/null || echo unknown)"
# NIXL's libraries travel packed (see gpu-bundle.sh).
if [ -f "$here/nixl.tar.zst" ] && [ ! -d "$here/nixl" ]; then
  "$here/zstd" -dc "$here/nixl.tar.zst" | tar -C "$here" -xf - || echo "== could not unpack NIXL"
fi
# So do the programs (five stripped binaries are about 50 MB; packed they
# leave the bundle well under the 64 MiB a device call carries).
if [ -f "$here/bin.tar.zst" ] && [ ! -d "$here/bin" ]; then
  "$here/zstd" -dc "$here/bin.tar.zst" | tar -C "$here" -xf - || { echo "== could not unpack the programs"; exit 1; }
fi
[ -d "$here/nixl" ] && export RDT_NIXL_DIR="$here/nixl"
echo "== host: $(hostname)  date: $(date -u +%FT%TZ)  rdt commit: $RDT_COMMIT  RDT_EXPECT_GPUS=${RDT_EXPECT_GPUS:-}"
# cuRAND and NVRTC (on-device random fill, sum and compare) and cuBLAS
# (bench_nccl's overlap workload) ship with the CUDA toolkit and with
# PyTorch's nvidia-* wheels; NCCL is found by the binaries themselves
# (libnccl.so.2 or libnccl.so on the loader path, or RDT_NCCL_LIBRARY). Where the loader does not
# know them, look in RDT_CUDA_LIB_DIRS and the usual places, and say what
# was added.
known() { ldconfig -p 2>/dev/null | grep -q "$1"; }
for lib in libnvrtc.so libcurand.so libcublas.so; do
  known "$lib" && continue
  for d in ${RDT_CUDA_LIB_DIRS:-} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           /usr/local/lib/python3*/dist-packages/nvidia/*/lib /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib; do
    if [ -d "$d" ] && ls "$d" 2>/dev/null | grep -q "^$lib"; then
      case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d";; esac
      echo "== $lib: not on the loader path; using $d"
      break
    fi
  done
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv 2>&1 || true
rc=0
# RDT_GPU_PARTS=a,b,... runs only those parts (quickstart, interop, tests,
# cuda, nccl, nixl, weightsync, control), to fit a run into a time limit.
want() { [ -z "${RDT_GPU_PARTS:-}" ] || [[ ",$RDT_GPU_PARTS," == *",$1,"* ]]; }
if want quickstart; then
echo "== quickstart (the README's first command; on a GPU host it must pick cuda_ipc)"
"$here/bin/quickstart" 2>&1 | tee "$logs/quickstart.log"
q=${PIPESTATUS[0]}
grep -q "via cuda_ipc" "$logs/quickstart.log" || { echo "quickstart did not use the GPU"; q=1; }
[ "$q" = 0 ] || rc=$q
echo "== quickstart exit: $q"
fi
if want interop; then
echo "== interop_candle (a candle tensor through DLPack to an actor and back)"
"$here/bin/interop_candle" 2>&1 | tee "$logs/interop_candle.log"
q=${PIPESTATUS[0]}
[ "$q" = 0 ] || rc=$q
echo "== interop_candle exit: $q"
echo "== interop_cudarc (a cudarc CudaSlice through DLPack over cuda_ipc to an actor and back into cudarc)"
"$here/bin/interop_cudarc" 2>&1 | tee "$logs/interop_cudarc.log"
q=${PIPESTATUS[0]}
[ "$q" = 0 ] || rc=$q
echo "== interop_cudarc exit: $q"
fi
passed=0; failed=0; skipped=0
if want tests; then
# The gpu tests: the one-GPU tests, then the two-GPU tests (#[ignore]d in
# the binary) where two GPUs are visible or RDT_EXPECT_GPUS asks for two
# (then fewer is a failure: the tests assert it). The summary adds up
# libtest's `test result:` lines; a run without one (the binary died)
# counts every test it was to run as failed.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  vis=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  [ "$vis" -lt "$gpus" ] && gpus=$vis
fi
two=$("$here/bin/gpu-tests" --list --ignored 2>/dev/null | grep -c ': test$')
all=$("$here/bin/gpu-tests" --list 2>/dev/null | grep -c ': test$')
one=$((all - two))
# "passed failed ignored" of the last `test result:` line of a log.
result() {
  grep -E '^test result: ' "$1" | tail -n1 \
    | sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored;.*/\1 \2 \3/'
}
echo "== gpu tests ($one one-GPU tests; $two two-GPU tests; $gpus GPU(s) visible)"
"$here/bin/gpu-tests" --test-threads=1 2>&1 | tee "$logs/gpu-tests.log"
t=${PIPESTATUS[0]}; [ "$t" = 0 ] || rc=$t
echo "== gpu tests exit: $t"
read -r passed failed skipped <<<"$(result "$logs/gpu-tests.log")"
[ -n "${passed:-}" ] || { passed=0; failed=$one; skipped=$two; }
if [ "$gpus" -ge 2 ] || [ "${RDT_EXPECT_GPUS:-0}" -ge 2 ] 2>/dev/null; then
  echo "== gpu tests, two GPUs (--ignored)"
  "$here/bin/gpu-tests" --ignored --test-threads=1 2>&1 | tee "$logs/gpu-tests-2gpu.log"
  t2=${PIPESTATUS[0]}; [ "$t2" = 0 ] || rc=$t2
  echo "== gpu tests, two GPUs exit: $t2"
  read -r p2 f2 _ <<<"$(result "$logs/gpu-tests-2gpu.log")"
  [ -n "${p2:-}" ] || { p2=0; f2=$two; }
  passed=$((passed + p2)); failed=$((failed + f2)); skipped=$((skipped - p2 - f2))
else
  echo "== gpu tests, two GPUs: not run ($gpus GPU(s) visible): $two skipped"
fi
fi
if want cuda; then
echo "== bench_cuda"
"$here/bin/bench_cuda" --json "$logs/cuda.json" 2>&1 | tee "$logs/bench_cuda.log"
b=${PIPESTATUS[0]}; [ "$b" = 0 ] || rc=$b
echo "== bench_cuda exit: $b"
fi
if want nccl; then
echo "== bench_nccl"
"$here/bin/bench_nccl" --json "$logs/nccl.json" 2>&1 | tee "$logs/bench_nccl.log"
n=${PIPESTATUS[0]}; [ "$n" = 0 ] || rc=$n
echo "== bench_nccl exit: $n"
fi
if want nixl; then
echo "== bench_nixl"
"$here/bin/bench_nixl" --json "$logs/nixl.json" 2>&1 | tee "$logs/bench_nixl.log"
x=${PIPESTATUS[0]}; [ "$x" = 0 ] || rc=$x
echo "== bench_nixl exit: $x"
fi
if want weightsync; then
# Weight sync on the GPU (cuda_ipc, colocated on GPU 0): the example with
# every checksum checked, then the weightsync suite (the 1 000 x 64 KiB
# case and the many-tensor series over cuda_ipc and nixl; the 8b layout,
# 16 GB, and fan-out of 1.5b over cuda_ipc only: same-GPU nixl goes
# through UCX's TCP path, 190 s a version for 8b).
echo "== weight_sync example (toy, 4 rollouts)"
"$here/bin/weight_sync" --model toy --rollouts 4 2>&1 | tee "$logs/weight_sync_toy.log"
w=${PIPESTATUS[0]}; [ "$w" = 0 ] || rc=$w
echo "== weight_sync example exit: $w"
echo "== bench weightsync"
"$here/bin/bench" weightsync --json "$logs/weightsync.json" 2>&1 | tee "$logs/bench_weightsync.log"
w=${PIPESTATUS[0]}; [ "$w" = 0 ] || rc=$w
echo "== bench weightsync exit: $w"
echo "== bench weightsync --model 8b (cuda_ipc, 1 rollout)"
"$here/bin/bench" weightsync --model 8b --rollouts 1 --transport cuda_ipc --json "$logs/weightsync-8b.json" 2>&1 | tee "$logs/bench_weightsync_8b.log"
w=${PIPESTATUS[0]}; [ "$w" = 0 ] || rc=$w
echo "== bench weightsync --model 8b exit: $w"
echo "== bench weightsync --model 1.5b (cuda_ipc, 1 and 4 rollouts)"
"$here/bin/bench" weightsync --model 1.5b --rollouts 1,4 --transport cuda_ipc --json "$logs/weightsync-1.5b.json" 2>&1 | tee "$logs/bench_weightsync_1.5b.log"
w=${PIPESTATUS[0]}; [ "$w" = 0 ] || rc=$w
echo "== bench weightsync --model 1.5b exit: $w"
fi
if want control; then
# The control plane on this host (CPU only): bare socket echo vs a tiny
# actor call, the floor under every pass above.
echo "== bench control"
"$here/bin/bench" control --json "$logs/control.json" 2>&1 | tee "$logs/bench_control.log"
c=${PIPESTATUS[0]}; [ "$c" = 0 ] || rc=$c
echo "== bench control exit: $c"
fi
echo "gpu tests: $passed passed, $failed failed, $skipped skipped"
exit $rc
RUN
chmod +x "$out/run.sh" "$out/bin/"*
# Debug info is not needed on the GPU host and would double the size.
command -v strip >/dev/null && strip --strip-debug "$out/bin/"*
# Packed for the trip (run.sh unpacks them).
tar -C "$out" -cf - bin | zstd -19 -T0 -q -o "$out/bin.tar.zst"
rm -rf "$out/bin"
du -sh "$out"
