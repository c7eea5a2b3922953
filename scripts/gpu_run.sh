#!/usr/bin/env bash
# Build jax_gin's CUDA extension on a GPU machine and check or measure it, in one call.
# Uses the machine's own python3, nvcc, cmake and NCCL wheel; installs nothing. Logs and
# results go under $OUT (default ./gpu_out).
#
#   bash scripts/gpu_run.sh test       native harness (N = 2, 3, 4, 8; several buffers a call;
#                                      GIN emulated; copy engines; in place; flight recorder;
#                                      psum_add_rmsnorm and psum_add_layernorm in one kernel;
#                                      psum_scatter and all_gather; fault injection),
#                                      compute-sanitizer, the GPU pytest suite and the
#                                      2-process GPU tests
#   bash scripts/gpu_run.sh native     test's native harness and compute-sanitizer alone
#   bash scripts/gpu_run.sh pytest [FILE...]  test's GPU pytest suite and 2-process tests
#                                      alone (with native, test in two calls of a machine that
#                                      limits each command's time); given test files or pytest
#                                      node ids, those alone under JAX_PLATFORMS=cuda, so that
#                                      the suite can run in parts (the 2-process file runs with
#                                      the whole suite only: its parent process is a CPU one)
#   bash scripts/gpu_run.sh record     the results of record: the op sweep (auto and lax, float32,
#                                      4 KiB - 1 GiB) and the whole-step workloads
#                                      (dp-train, fsdp, tp-train, tp-decode, overlap at 256 and
#                                      64 MiB); copy $OUT into
#                                      benchmarks/results/<machine>/
#   bash scripts/gpu_run.sh workloads  the workloads alone
#   bash scripts/gpu_run.sh collectives  the psum_scatter and all_gather sweep (auto and lax,
#                                      float32 and bfloat16, 4 KiB - 1 GiB on the larger side)
#   bash scripts/gpu_run.sh ceiling    NVLink ceilings (copy engines, SM push and pull by CTAs)
#   bash scripts/gpu_run.sh recorder   the flight recorder's cost, kernels alone: no recorder,
#                                      off and on, in turns (the table of docs/design.md)
set -uo pipefail
MODE=${1:-test}
shift $(( $# > 0 ))
SELECTED=("$@")  # pytest mode: the tests to run (default: all)
if [ ${#SELECTED[@]} -gt 0 ] && [ "$MODE" != pytest ]; then
  echo "gpu_run.sh: only the pytest mode takes test files (got '$MODE ${SELECTED[*]}')" >&2; exit 2
fi
case "$MODE" in test|native|pytest|record|workloads|collectives|ceiling|recorder) ;;
  *) echo "usage: bash scripts/gpu_run.sh test|native|pytest|record|workloads|collectives|ceiling|recorder (got '$MODE')" >&2; exit 2 ;;
esac
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
log() { echo "== $(date +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }

# The commit measured: JAX_GIN_COMMIT where the tree was copied without its current .git.
COMMIT=${JAX_GIN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "machine, commit $COMMIT"
{ echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $COMMIT";
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvcc --version | tail -1;
  $PY -c "import jax, jaxlib, nvidia.nccl as n; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'nccl wheel', list(n.__path__))";
  nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
head -3 "$OUT/machine.txt"

log "build"
cmake -S . -B build/gpu -G Ninja -DJAX_GIN_CUDA=ON -DPython_EXECUTABLE="$(command -v $PY)" \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 &&
  cmake --build build/gpu -j "$(nproc)" >> "$OUT/build.log" 2>&1
rc=$?
log "build rc=$rc"
if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
cp build/gpu/_jax_gin*.so jax_gin/
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
H=build/gpu/jax_gin_cuda_harness

harness() {
  log "native harness: N = 2, 3, 4, 8 as streams on the GPUs present, every algorithm"
  $H --ranks 2,3,4,8 --dtypes f32,bf16,f16,i32,f64 --iters 3 > "$OUT/harness.log" 2>&1
  log "harness rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --dtypes f32,bf16,f64 --ops sum,max --iters 2 --chunk-bytes 256 >> "$OUT/harness.log" 2>&1
  log "harness, tiny chunks rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --dtypes f32,bf16,i32 --ops sum,max --iters 2 --segments 5 \
    --counts 7,1000,4099,300001 >> "$OUT/harness.log" 2>&1
  log "harness, 5 buffers a call (a pytree's leaves) rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --dtypes f32,bf16 --ops sum --iters 2 --segments 64 --counts 1000,300001 \
    --lane-bytes 4096 --chunk-bytes 256 >> "$OUT/harness.log" 2>&1
  log "harness, 64 buffers a call over several rounds rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 4,8 --ranks-per-node 2,4 --dtypes f32,bf16,f16,i32,f64 --iters 3 >> "$OUT/harness.log" 2>&1
  log "harness, hierarchical (GIN emulated over P2P) rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --dtypes f32,bf16 --iters 2 --record 1 >> "$OUT/harness.log" 2>&1
  log "harness, flight recorder on and checked rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --algos one_shot --counts 1,1000 --dtypes f32,bf16,f16 --iters 2 \
    --add-rmsnorm 1 --record 1 >> "$OUT/harness.log" 2>&1
  log "harness, the fused norms in one kernel against two, recorded rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --algos one_shot --counts 1,1000,4099,65537 --dtypes f32,bf16 --iters 2 \
    --ll-round-start 4294967294 --add-rmsnorm 1 >> "$OUT/harness.log" 2>&1
  log "harness, LL rounds across the flags' 32-bit wrap rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --lane-bytes 4096 --algos copy_engine,two_shot,copy_engine,ring \
    --counts 1,1001,300001,1000003 --dtypes f32,bf16 --ops sum,max --iters 2 >> "$OUT/harness.log" 2>&1
  log "harness, copy engines over several rounds rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,4 --algos ring,tree,two_shot,one_shot,copy_engine --counts 1,1000,300001 \
    --dtypes f32 --ops sum --iters 2 --late-rank 1 --late-ms 5 >> "$OUT/harness.log" 2>&1
  log "harness, a late rank: waits published and cleared rc=$? $(tail -1 "$OUT/harness.log")"
  $H --collectives only --ranks 1,2,3,4,8 --dtypes f32,f64,bf16,f16,i32,i64,u32 \
    >> "$OUT/harness.log" 2>&1
  log "harness, psum_scatter and all_gather rc=$? $(tail -1 "$OUT/harness.log")"
  $H --collectives only --ranks 2,3,8 --dtypes f32,bf16,f64 --lane-bytes 4096 --chunk-bytes 256 \
    --block-bytes 16,48,1008,65584,262160 >> "$OUT/harness.log" 2>&1
  log "harness, psum_scatter and all_gather over several rounds rc=$? $(tail -1 "$OUT/harness.log")"
  $H --collectives 1 --ranks 2,3,4,8 --dtypes f32,bf16 --ops sum,max --iters 2 --counts 7,1000,4099 \
    --lane-bytes 4096 --chunk-bytes 256 >> "$OUT/harness.log" 2>&1
  log "harness, psum_scatter and all_gather after all-reduces on one window rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,3,4,8 --algos ring,tree,one_shot,two_shot,copy_engine --dtypes f32,bf16 --ops sum,max \
    --iters 2 --counts 1,1000,300001 --in-place 1 >> "$OUT/harness.log" 2>&1
  log "harness, in place (the asynchronous start's buffers) rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2,4 --algos ring,tree,one_shot,two_shot --dtypes f32 --ops sum --iters 2 --segments 5 \
    --counts 7,1000,300001 --in-place 1 >> "$OUT/harness.log" 2>&1
  log "harness, in place, 5 buffers a call rc=$? $(tail -1 "$OUT/harness.log")"
  $H --ranks 2 --counts 1000 --algos one_shot --dtypes f32 --ops sum --iters 1 --timeout-s 1 \
    --fault-rank 1 >> "$OUT/harness.log" 2>&1
  log "fault injection rc=$? (3 expected): $(grep -m1 'timed out' "$OUT/harness.log")"
  log "$(grep -m1 '^diagnosis' "$OUT/harness.log")"
  # every report ends with its group's line (describe's last argument)
  log "reports ending with the group's line: $(grep -c '^group 0 of the harness' "$OUT/harness.log") of $(grep -c '^jax_gin .* timed out waiting' "$OUT/harness.log")"
  # many waits time out at once (every thread of an LL launch, thread 0 of every lane of a
  # ring): the first to claim the report must finish it before any traps, every run
  rcs=""
  for c in "one_shot 1000" "one_shot 1000" "one_shot 1000" "ring 3000001" "ring 3000001"; do
    read -r algo count <<< "$c"
    $H --ranks 8 --counts "$count" --algos "$algo" --dtypes f32 --ops sum --iters 1 --timeout-s 1 \
      --fault-rank 3 >> "$OUT/harness.log" 2>&1
    rcs+="$? "
  done
  log "fault injection, many waits timing out at once, 5 runs: rc $rcs(3 each expected)"
  # a tree over several chunks: the faulty rank may wait at the same step as its waiters
  $H --ranks 8 --counts 100000 --algos tree --dtypes f32 --ops sum --iters 1 --timeout-s 1 \
    --chunk-bytes 4096 --fault-rank 5 >> "$OUT/harness.log" 2>&1
  log "fault injection, tree rc=$? (3 expected): $(grep '^diagnosis' "$OUT/harness.log" | tail -1)"
  $H --collectives only --ranks 2 --dtypes f32 --algos ring --block-bytes 4096 --timeout-s 1 \
    --fault-rank 1 >> "$OUT/harness.log" 2>&1
  log "fault injection, psum_scatter rc=$? (3 expected): $(grep 'timed out' "$OUT/harness.log" | tail -1)"
  log "$(grep '^diagnosis' "$OUT/harness.log" | tail -1)"
  grep FAIL "$OUT/harness.log" | head -5
}

sanitizer() {
  compute-sanitizer --tool memcheck --error-exitcode 9 $H --ranks 2 --counts 1,1000,4099 \
    --dtypes f32,bf16 --ops sum --iters 2 > "$OUT/sanitizer.log" 2>&1
  log "memcheck rc=$? $(grep -m1 'ERROR SUMMARY' "$OUT/sanitizer.log")"
  compute-sanitizer --tool racecheck --error-exitcode 9 $H --ranks 2 --counts 1000,40000 \
    --dtypes f32 --ops sum --iters 1 --chunk-bytes 4096 >> "$OUT/sanitizer.log" 2>&1
  log "racecheck rc=$? $(grep -i 'hazard\|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
}

pytests() {
  # -v and --durations: a run cut by the timeout names the test it was in, and a full run
  # names the slowest tests
  if [ ${#SELECTED[@]} -gt 0 ]; then
    JAX_PLATFORMS=cuda timeout 540 $PY -m pytest -v --durations=25 -p no:cacheprovider \
      "${SELECTED[@]}" > "$OUT/pytest.log" 2>&1
    log "pytest ${SELECTED[*]} (JAX_PLATFORMS=cuda) rc=$? $(tail -1 "$OUT/pytest.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -10
    return
  fi
  JAX_PLATFORMS=cuda timeout 420 $PY -m pytest -v --durations=25 -p no:cacheprovider tests/ \
    > "$OUT/pytest.log" 2>&1
  log "pytest (JAX_PLATFORMS=cuda) rc=$? $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -10
  JAX_PLATFORMS=cpu timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu_multiprocess.py \
    > "$OUT/pytest_2proc.log" 2>&1
  log "pytest, 2 processes x 1 GPU rc=$? $(tail -1 "$OUT/pytest_2proc.log")"
}

sweep() {
  JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 1G -f 4 -d float32 -a auto,lax -n 10 -w 3 \
    --json "$OUT/sweep.json" --plot "$OUT/sweep.png" > "$OUT/sweep.txt" 2>> "$OUT/build.log"
  log "op sweep rc=$?"
  grep -E "^#.*(Geomean|Avg)" "$OUT/sweep.txt"
}

collectives() {
  JAX_PLATFORMS=cuda $PY -m jax_gin.bench -c psum_scatter,all_gather -b 4K -e 1G -f 4 \
    -d float32,bfloat16 -a auto,lax -n 10 -w 3 --json "$OUT/collectives.json" \
    > "$OUT/collectives.txt" 2>> "$OUT/build.log"
  log "psum_scatter and all_gather sweep rc=$?"
  grep -E "^#.*(Geomean|Avg)" "$OUT/collectives.txt"
}

workloads() {
  # the overlap workload with --overlap: jax_gin as psum_overlapping beside the matmuls
  for spec in "dp-train dp-train" "fsdp fsdp" "tp-train tp-train" "tp-decode tp-decode" \
              "overlap overlap --overlap" "overlap_64mib overlap --overlap --mib 64"; do
    set -- $spec; name=$1; shift
    JAX_PLATFORMS=cuda timeout 240 $PY -m jax_gin.bench --workload "$@" --json "$OUT/$name.json" \
      > "$OUT/$name.txt" 2>> "$OUT/build.log"
    log "workload $name rc=$?"
    grep -E "^ |lax / jax_gin|bitwise|together" "$OUT/$name.txt"
  done
}

# The recorder's cost: 2 ranks on the first GPU(s), float32 sum, 2000 calls as CUDA-graph
# replays; no recorder (-1), off (0, as the runtime leaves it) and on (1) in turns, 4 runs;
# recorder_cost.txt gives each one's best run and the others against no recorder.
recorder() {
  : > "$OUT/recorder_times.txt"
  for run in 1 2 3 4; do
    for rec in -1 0 1; do
      $H --ranks 2 --algos one_shot,two_shot,ring,tree --counts 1024,262144,4194304 --dtypes f32 \
        --ops sum --iters 1 --time-iters 2000 --time-graph 1 --record $rec 2>&1 | grep -E '^(time|FAIL)' \
        | sed "s/^/record=$rec /" >> "$OUT/recorder_times.txt"
    done
  done
  $PY - "$OUT/recorder_times.txt" > "$OUT/recorder_cost.txt" <<'PYEOF'
import re, sys
best = {}
for line in open(sys.argv[1]):
    m = re.match(r"record=(-?\d) .* algo=(\S+) bytes=(\d+): ([\d.]+) us/call", line)
    if m:
        key = (m[2], int(m[3]), int(m[1]))
        best[key] = min(best.get(key, float("inf")), float(m[4]))
print("| algorithm | bytes | no recorder | off | on |\n|---|---|---|---|---|")
for algo, size in sorted({k[:2] for k in best}):
    t = [best.get((algo, size, r)) for r in (-1, 0, 1)]
    if None not in t:
        cells = [f"{t[0]:.2f}"] + [f"{x:.2f} ({100 * (x / t[0] - 1):+.1f}%)" for x in t[1:]]
        print(f"| {algo} | {size} | " + " | ".join(cells) + " |")
PYEOF
  log "recorder cost rc=$?; recorder check failures (must be 0): $(grep -c FAIL "$OUT/recorder_times.txt")"
  cat "$OUT/recorder_cost.txt"
}

case "$MODE" in
  test) harness; sanitizer; pytests ;;
  native) harness; sanitizer ;;
  pytest) pytests ;;
  record) sweep; workloads ;;
  workloads) workloads ;;
  collectives) collectives ;;
  ceiling) build/gpu/jax_gin_nvlink_bw > "$OUT/ceiling.txt" 2>&1; log "nvlink_bw rc=$?"; cat "$OUT/ceiling.txt" ;;
  recorder) recorder ;;
esac
log "done"
