#!/usr/bin/env bash
# Build the CUDA extension on the GPU machine, run the GPU tests and the benchmark, in one call.
# Logs and results go under $OUT (default ./gpu_out). Uses the machine's own python3, nvcc,
# cmake and NCCL wheel; installs nothing.
#
#   scripts/gpu_run.sh [mode]   (default: full; the modes are listed below and in the case at the end)
#   gin: only the native harness's hierarchical (GIN emulated) cases, one GPU is enough
#   x2: the runs that need two GPUs, in one call; final2: harness, 2-process tests, float32 sweep
#   ceiling: NVLink ceilings (copy engines, SM push/pull) and kernel-only times at 64 MiB - 1 GiB
#   validate: 128 vs 132 lanes, harness, sanitizers, GPU pytest (after a kernel change)
#   record2: the results of record (table sweep, tune, record sweep, bench_mlp)
#   smallrec / autocheck: 4 KiB - 4 MiB with a chain of 100 (every algorithm / auto vs lax)
#   final3: the 2-process tests and benchmark, and the two chain steps at small sizes
#   cmdprobe: does XLA capture jax_gin's calls in command buffers (verbose compiler log, dump,
#             pure chains of jax_gin calls with nothing between them)
#   kprobe: kernel device times (LL limit, lane grain) and XLA's command-buffer log per execution
#   llcheck: one_shot over LL up to 256 KiB (harness correctness, fault, times), chunk sweep,
#            then the harness, sanitizers and the GPU pytest files
#   oneshot: pipelined one_shot: harness correctness over chunk sizes, kernel times per chunk
#   decompose: kernel alone (harness) next to the per-op time in XLA, 4 KiB - 16 MiB
#   multiproc: 2 processes x 1 GPU on localhost (jax.distributed), tests/test_gpu_multiprocess.py
#              and the float32 benchmark in that mode (bench_2proc.txt)
#   single: what a 1-GPU machine can check (every rank of the harness on GPU 0, the GPU tests
#           that need one device, kernel timings of ranks sharing one GPU)
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
log() { echo "== $(date +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }
# XLA's command buffers forced on for custom calls and collectives, even single ops
# (decompose, cmdprobe); `graphs` keeps its own set, with CUBLAS, as its results were taken.
CMDBUF_ON="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1"

log "machine"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvcc --version | tail -1;
  $PY -c "import jax, jaxlib, nvidia.nccl as n; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'nccl wheel', list(n.__path__))";
  nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | head -5

log "build"
t0=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DJAX_GIN_CUDA=ON -DPython_EXECUTABLE="$(command -v $PY)" \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 &&
  cmake --build build/gpu -j "$(nproc)" >> "$OUT/build.log" 2>&1
rc=$?
log "build rc=$rc in $(( $(date +%s) - t0 )) s"
if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
cp build/gpu/_jax_gin*.so jax_gin/
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
H=build/gpu/jax_gin_cuda_harness

harness() {
  log "native harness: ranks 2,3,4,8 as streams on the GPUs present"
  $H --ranks 2,3,4,8 --dtypes f32,bf16,f16,i32,f64 --iters 3 > "$OUT/harness.log" 2>&1
  log "harness rc=$? $(tail -1 "$OUT/harness.log")"
  grep FAIL "$OUT/harness.log" | head -5
  log "native harness: tiny pipelining chunks (many chunks per step, empty ones too)"
  $H --ranks 2,3,4,8 --dtypes f32,bf16,f64 --ops sum,max --iters 2 --chunk-bytes 256 >> "$OUT/harness.log" 2>&1
  log "harness chunks rc=$? $(tail -1 "$OUT/harness.log")"
  grep FAIL "$OUT/harness.log" | head -5
  log "harness fault injection (rank 1 drops its signals, 1 s timeout)"
  $H --ranks 2 --counts 1000 --algos one_shot --dtypes f32 --ops sum --iters 1 --timeout-s 1 \
    --fault-rank 1 > "$OUT/harness_fault.log" 2>&1
  log "fault rc=$? (3 expected): $(grep -m1 'timed out' "$OUT/harness_fault.log")"
  cat "$OUT/harness_fault.log" >> "$OUT/harness.log"; rm -f "$OUT/harness_fault.log"
  harness_gin
}

# The hierarchical kernel of groups that span nodes, with GIN emulated over P2P (transport.cuh,
# EmulatedGinRail): ranks node*L .. node*L+L-1 play a node. Works on one GPU (all ranks there).
harness_gin() {
  log "harness hierarchical: groups spanning 'nodes' of 2 and 4 ranks, GIN emulated over P2P"
  $H --ranks 4,8 --ranks-per-node 2,4 --dtypes f32,bf16,f16,i32,f64 --iters 3 > "$OUT/harness_gin.log" 2>&1
  log "harness hierarchical rc=$? $(tail -1 "$OUT/harness_gin.log")"
  # tiny lanes: many rounds, so outboxes are reused and signal deltas span rounds
  $H --ranks 2,4,6,8 --ranks-per-node 1,2,3,4 --lane-bytes 8192 --counts 1,7,1000,4099,300001 \
    --dtypes f32,bf16,f64 --iters 3 >> "$OUT/harness_gin.log" 2>&1
  log "harness hierarchical, many rounds rc=$? $(tail -1 "$OUT/harness_gin.log")"
  grep FAIL "$OUT/harness_gin.log" | head -5
  cat "$OUT/harness_gin.log" >> "$OUT/harness.log"; rm -f "$OUT/harness_gin.log"
  log "harness GIN fault injection (rank 1 drops its rail signals, 1 s timeout)"
  $H --ranks 4 --ranks-per-node 2 --counts 1000 --dtypes f32 --ops sum --iters 1 --timeout-s 1 \
    --fault-rank 1 > "$OUT/harness_fault.log" 2>&1
  log "GIN fault rc=$? (3 expected; rank 3 waits for its rail peer 1 at step 1 of round 1)"
  grep 'timed out' "$OUT/harness_fault.log" | head -4 | tee -a "$OUT/summary.txt"
  cat "$OUT/harness_fault.log" >> "$OUT/harness.log"; rm -f "$OUT/harness_fault.log"
}

# Kernel-level latency, no XLA: one_shot over LL vs the simple protocol, two_shot, ring.
latency() {
  log "kernel latency (native harness, 2 ranks on 2 GPUs, 2000 back-to-back calls)"
  for ll in 65536 0; do
    $H --ranks 2 --counts 1024,16384 --algos one_shot,two_shot --dtypes f32 --ops sum --iters 1 \
      --time-iters 2000 --ll-max-bytes $ll | grep -E "^time" | sed "s/^/ll_max=$ll /" | tee -a "$OUT/summary.txt"
  done
}

sanitizer() {
  log "compute-sanitizer memcheck + racecheck (small native case)"
  compute-sanitizer --tool memcheck --error-exitcode 9 $H --ranks 2 --counts 1,1000,4099 \
    --dtypes f32,bf16 --ops sum --iters 2 > "$OUT/memcheck.log" 2>&1
  log "memcheck rc=$? $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
  compute-sanitizer --tool racecheck --error-exitcode 9 $H --ranks 2 --counts 1000,40000 \
    --dtypes f32 --ops sum --iters 1 --chunk-bytes 4096 > "$OUT/racecheck.log" 2>&1
  log "racecheck rc=$? $(grep -m1 -i 'hazard\|ERROR SUMMARY' "$OUT/racecheck.log")"
  cat "$OUT/memcheck.log" "$OUT/racecheck.log" >> "$OUT/harness.log"; rm -f "$OUT/memcheck.log" "$OUT/racecheck.log"
}

tests() {
  log "pytest JAX_PLATFORMS=cuda"
  JAX_PLATFORMS=cuda timeout ${PYTEST_TIMEOUT:-480} $PY -m pytest -q -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_FILES:-tests/} > "$OUT/pytest.log" 2>&1
  log "pytest rc=$? $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -10
}

bench() {
  log "benchmark"
  JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e ${BENCH_MAX:-1G} -f 4 -d float32,bfloat16 \
    -a ${BENCH_ALGOS:-auto,one_shot,two_shot,ring,tree,lax} -n ${BENCH_ITERS:-20} -w 5 ${BENCH_K:+-k $BENCH_K} --json "$OUT/bench.json" \
    ${BENCH_DTYPES:+-d $BENCH_DTYPES} \
    --plot "$OUT/bench.png" > "$OUT/bench.txt" 2>> "$OUT/build.log"
  log "bench rc=$?"
}

# Command buffers (CUDA graphs): the same small sizes with XLA's command buffers off, and on
# for custom calls and collectives, both libraries side by side.
graphs() {
  for mode in off on; do
    if [ $mode = off ]; then F="--xla_gpu_enable_command_buffer="; else
      F="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1"; fi
    log "benchmark, command buffers $mode"
    XLA_FLAGS="$F" JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 1M -f 4 -d float32 \
      -a auto,one_shot,lax -n 20 -w 5 -k 20 > "$OUT/bench_cmdbuf_$mode.txt" 2>> "$OUT/build.log"
    log "rc=$?"
  done
}

# Several processes: 2 processes with one GPU each, joined by jax.distributed on 127.0.0.1
# (ncclCommInitRank bootstrap). The pytest process itself stays on CPU; its workers take a GPU
# each. jax_gin.bench runs in one process only, so there is no 2-process benchmark yet.
multiproc() {
  log "pytest tests/test_gpu_multiprocess.py (2 processes x 1 GPU)"
  JAX_PLATFORMS=cpu timeout ${PYTEST_TIMEOUT:-600} $PY -m pytest -q -p no:cacheprovider -rs \
    tests/test_gpu_multiprocess.py > "$OUT/pytest_multiproc.log" 2>&1
  log "pytest multiproc rc=$? $(tail -1 "$OUT/pytest_multiproc.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_multiproc.log" | head -10
  [ "${BENCH_2PROC:-1}" = 1 ] && bench_2proc
}

# The benchmark in that mode: the same command in 2 processes, one GPU each; process 0 prints.
bench_2proc() {
  log "benchmark, 2 processes x 1 GPU"
  local port=$((20000 + RANDOM % 20000))
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i JAX_PLATFORMS=cuda timeout 400 $PY -m jax_gin.bench -b 4K -e ${BENCH_MAX:-1G} -f 4 \
      -d float32 -a auto,one_shot,two_shot,ring,lax -n 20 -w 5 -k 20 --quiet \
      --coordinator 127.0.0.1:$port --num-processes 2 --process-id $i \
      > "$OUT/bench_2proc_$i.txt" 2>&1 &
  done
  wait
  log "bench 2 processes done"; mv "$OUT/bench_2proc_0.txt" "$OUT/bench_2proc.txt"
  tail -3 "$OUT/bench_2proc_1.txt"; rm -f "$OUT/bench_2proc_1.txt"
}

# Ranks sharing one GPU: HBM-bound, not NVLink-bound, so these times say how many passes over
# memory a kernel makes and what pipelining costs, not how fast it is between GPUs.
single_timing() {
  log "kernel timing, 2 and 4 ranks sharing one GPU, lane 1 MiB (as the runtime), chunk sweep"
  for cb in 0 32768 131072 524288; do
    $H --ranks 2,4 --counts 262144,4194304,16777216 --algos ring,tree,two_shot,one_shot --dtypes f32 --ops sum \
      --iters 1 --time-iters 50 --lane-bytes 1048576 --chunk-bytes $cb | grep -E "^time" | sed "s/^/chunk=$cb /" \
      >> "$OUT/timing.txt"
  done
  log "timing rc=$?"
}

# The runs that need 2 GPUs, in one call of at most 10 minutes, at most 8 files back.
x2() {
  log "native harness: ranks 2,4 on 2 GPUs (quick)"
  $H --ranks 2,4 --counts 1,4099,300001 --dtypes f32,bf16 --ops sum,max --iters 2 > "$OUT/harness.log" 2>&1
  log "harness rc=$? $(tail -1 "$OUT/harness.log")"
  BENCH_2PROC=0 multiproc
  JAX_PLATFORMS=cuda timeout 120 $PY -m jax_gin.bench_mlp --cmdbuf both --json "$OUT/bench_mlp.json" \
    > "$OUT/bench_mlp.txt" 2>> "$OUT/build.log"; log "bench_mlp rc=$?"
  BENCH_DTYPES=float32 bench
  cat "$OUT/machine.txt" >> "$OUT/summary.txt"; rm -f "$OUT/machine.txt" "$OUT/build.log"
}

# Issue 3's large-message target against what the hardware gives: NVLink per direction with
# both GPUs sending (copy engines, SM push and pull at several CTA counts), then jax_gin's
# kernels alone (native harness, no XLA, no chain subtract) at 64 MiB - 1 GiB, 1 MiB lanes.
ceiling() {
  log "NVLink ceilings (build/gpu/jax_gin_nvlink_bw)"
  build/gpu/jax_gin_nvlink_bw > "$OUT/ceiling.txt" 2>&1; log "nvlink_bw rc=$?"
  log "kernel-only times, 2 ranks on 2 GPUs"
  $H --ranks 2 --counts 16777216,67108864,268435456 --algos two_shot,ring,one_shot --dtypes f32 \
    --ops sum --iters 1 --time-iters 10 --lane-bytes 1048576 | grep -E "^time|FAIL" >> "$OUT/ceiling.txt" 2>&1
  log "harness rc=$?"; cat "$OUT/ceiling.txt"
}

# How many CTAs ("lanes") one all-reduce may use: the SM-push ceiling is 345 GB/s per direction
# with 64 CTAs and 362 with 132 (ceiling mode), so 64 lanes cap the large-message kernels.
# Kernel-only times with 64 and 128 lanes, 512 KiB and 1 MiB lanes, then the benchmark with
# JAX_GIN_MAX_LANES=64 and the default, side by side with lax.
lanes() {
  log "kernel-only times by max lanes and lane bytes, 2 ranks on 2 GPUs"
  for ml in 64 128; do for lb in 524288 1048576; do
    $H --ranks 2 --counts 262144,1048576,4194304,16777216,268435456 --algos two_shot,ring --dtypes f32 \
      --ops sum --iters 1 --time-iters 10 --lane-bytes $lb --max-lanes $ml | grep -E "^time|FAIL" \
      | sed "s/^/max_lanes=$ml lane_bytes=$lb /" >> "$OUT/lanes.txt"
  done; done
  log "harness rc=$?"; cat "$OUT/lanes.txt"
  for ml in 64 128; do
    log "benchmark JAX_GIN_MAX_LANES=$ml"
    JAX_GIN_MAX_LANES=$ml JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 256K -e 1G -f 4 -d float32 \
      -a auto,one_shot,two_shot,ring,lax -n 10 -w 3 -k 20 > "$OUT/bench_lanes$ml.txt" 2>> "$OUT/build.log"
    log "rc=$?"
  done
}

# 128 vs 132 lanes (one per SM) on the large-message kernels, and the SM-push ceiling at those
# CTA counts and at two CTAs per SM.
lanes132() {
  log "NVLink SM ceilings at 128, 132 and 264 CTAs"
  build/gpu/jax_gin_nvlink_bw --bytes 1073741824 --ctas 128,132,264 > "$OUT/lanes.txt" 2>&1
  log "kernel-only times, 128 and 132 lanes (512 KiB lanes), 2 ranks on 2 GPUs"
  for ml in 128 132; do
    $H --ranks 2 --counts 4194304,16777216,67108864,268435456 --algos two_shot,ring --dtypes f32 \
      --ops sum --iters 1 --time-iters 10 --lane-bytes 524288 --max-lanes $ml | grep -E "^time|FAIL" \
      | sed "s/^/max_lanes=$ml /" >> "$OUT/lanes.txt"
  done
  log "rc=$?"; cat "$OUT/lanes.txt"
}

# The results of record after a kernel change: a float32 sweep of every algorithm builds the
# tuning table (python -m jax_gin.tune --from-json), which replaces the shipped one for the
# record sweep (float32 and bfloat16, auto next to every algorithm and lax), then the MLP of
# many small all-reduces with command buffers off and on.
record2() {
  log "benchmark for the tuning table (float32, every algorithm and lax)"
  JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 1G -f 4 -d float32 -a one_shot,two_shot,ring,tree,lax \
    -n 10 -w 3 -k 20 --quiet --json "$OUT/bench_tune.json" > "$OUT/bench_tune.txt" 2>> "$OUT/build.log"
  log "rc=$?"
  $PY -m jax_gin.tune --from-json "$OUT/bench_tune.json" --out jax_gin/tuning/nvidia_h200_n2.json \
    | tee -a "$OUT/summary.txt"
  cp jax_gin/tuning/nvidia_h200_n2.json "$OUT/"; rm -f "$OUT/bench_tune.json"
  BENCH_ALGOS=auto,one_shot,two_shot,ring,tree,lax bench
  JAX_PLATFORMS=cuda timeout 120 $PY -m jax_gin.bench_mlp --cmdbuf both --json "$OUT/bench_mlp.json" \
    > "$OUT/bench_mlp.txt" 2>> "$OUT/build.log"; log "bench_mlp rc=$?"
  tail -5 "$OUT/build.log" >> "$OUT/summary.txt"
  cat "$OUT/machine.txt" >> "$OUT/summary.txt"; rm -f "$OUT/machine.txt" "$OUT/build.log"
}

# Small sizes, one process: the two chain steps side by side (is the per-op time at 4 KiB -
# 1 MiB the step's or the all-reduce's?).
small_steps() {
  for st in subtract slice; do
    JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 1M -f 4 -d float32 -a one_shot,two_shot,lax \
      -n 30 -w 5 -k 20 --chain-step $st --quiet > "$OUT/bench_small_$st.txt" 2>> "$OUT/build.log"
    log "small sizes, chain step $st rc=$?"
  done
}

# Small sizes with a long chain (K = 100): the per-op time of a 10 us op is the difference of
# two wall times of ~0.2 ms and ~1.2 ms, so host jitter of tens of us divides by 99, not 19.
smallrec() {
  JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 4M -f 4 -d float32 -a auto,one_shot,two_shot,ring,lax \
    -n 20 -w 5 -k 100 --quiet --json "$OUT/bench_small_k100.json" > "$OUT/bench_small_k100.txt" 2>> "$OUT/build.log"
  log "small sizes float32 K=100 rc=$?"
  JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 1M -f 4 -d bfloat16 -a auto,one_shot,two_shot,lax \
    -n 20 -w 5 -k 100 --quiet --json "$OUT/bench_small_k100_bf16.json" > "$OUT/bench_small_k100_bf16.txt" 2>> "$OUT/build.log"
  log "small sizes bfloat16 K=100 rc=$?"
}

# Issue 3's small and mid sizes: where does the per-op time go? The kernel alone (native
# harness, 2000 back-to-back calls, no XLA) next to the per-op time in XLA (chain of 100),
# both libraries, 4 KiB - 16 MiB. Per-op minus kernel = what XLA's program adds per op.
decompose() {
  local C=1024,4096,16384,65536,262144,1048576,4194304
  log "kernel alone, 2 ranks on 2 GPUs: host launch loop, then CUDA-graph replay"
  $H --ranks 2 --counts $C --algos one_shot,two_shot,ring \
    --dtypes f32 --ops sum --iters 1 --time-iters 2000 | grep -E "^time|FAIL" > "$OUT/decompose.txt"
  $H --ranks 2 --counts $C --algos one_shot,two_shot,ring \
    --dtypes f32 --ops sum --iters 1 --time-iters 2000 --time-graph 1 | grep -E "^time|FAIL" >> "$OUT/decompose.txt"
  log "harness rc=$?"
  $PY scripts/xla_chain_hlo.py --tag default >> "$OUT/decompose.txt" 2>> "$OUT/build.log"
  XLA_FLAGS="$CMDBUF_ON" $PY scripts/xla_chain_hlo.py --tag cmdbuf_on >> "$OUT/decompose.txt" 2>> "$OUT/build.log"
  log "hlo rc=$?"
  tar czf "$OUT/hlo.tgz" -C "$OUT" $(cd "$OUT" && ls hlo_*.txt) && rm -f "$OUT"/hlo_*.txt
  for mode in default on; do
    local flags=""; [ $mode = on ] && flags="$CMDBUF_ON"
    XLA_FLAGS="$flags" JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 16M -f 4 -d float32 \
      -a one_shot,two_shot,ring,lax -n 20 -w 5 -k 100 --quiet > "$OUT/bench_decompose_$mode.txt" 2>> "$OUT/build.log"
    log "bench ($mode command buffers) rc=$?"
  done
  cat "$OUT/decompose.txt"
}

cmdprobe() {
  # Does XLA put jax_gin's calls in command buffers here? The compiler's own log of the
  # command-buffer passes, the dumped program, and pure chains (nothing between the calls).
  log "XLA command-buffer passes, verbose (default flags)"
  mkdir -p "$OUT/dump"
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=3,command_buffer_scheduling=3,command_buffer_thunk=1,custom_call_thunk=2 \
    XLA_FLAGS="--xla_dump_to=$OUT/dump --xla_dump_hlo_module_re=chain" \
    $PY scripts/xla_chain_hlo.py --tag vlog > "$OUT/cmdprobe.txt" 2> "$OUT/vlog.txt"
  log "vlog rc=$? lines=$(wc -l < "$OUT/vlog.txt")"
  grep -i -E "command|graph|custom" "$OUT/vlog.txt" | cut -c1-400 | head -150 >> "$OUT/cmdprobe.txt"
  tar czf "$OUT/dump.tgz" -C "$OUT" dump vlog.txt $(cd "$OUT" && ls hlo_*.txt) && rm -rf "$OUT/dump" "$OUT"/hlo_*.txt "$OUT/vlog.txt"
  for flags in "" "$CMDBUF_ON"; do
    XLA_FLAGS="$flags" JAX_PLATFORMS=cuda $PY scripts/xla_chain_probe.py >> "$OUT/cmdprobe.txt" 2>> "$OUT/build.log"
    log "probe rc=$?"
  done
  grep -v "^I\|^W" "$OUT/cmdprobe.txt" | grep -E "^#|pure|slice|vlog" | tee -a "$OUT/summary.txt"
}

kprobe() {
  # Kernel device time (graph replay, the runtime's 512 KiB lanes): LL one_shot up to 256 KiB,
  # and the lane grain at 1 - 16 MiB; then what XLA's command-buffer thunk does per execution.
  local G="--ranks 2 --dtypes f32 --ops sum --iters 1 --time-iters 1000 --time-graph 1 --lane-bytes 524288"
  log "one_shot, LL up to 64 KiB (default) and up to 256 KiB"
  for ll in 65536 262144; do
    $H $G --counts 16384,32768,65536 --algos one_shot --ll-max-bytes $ll | grep -E "^time|FAIL" | sed "s/^/ll=$ll /" >> "$OUT/kprobe.txt"
  done
  log "lane grain 16/32/64 KiB at 1 - 16 MiB"
  for g in 16384 32768 65536; do
    $H $G --counts 262144,1048576,4194304 --algos one_shot,two_shot,ring --lane-grain $g | grep -E "^time|FAIL" | sed "s/^/grain=$g /" >> "$OUT/kprobe.txt"
  done
  log "harness rc=$?"
  for keep in "" "--keep"; do
    echo "# vlog $keep" >> "$OUT/kprobe.txt"
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=3,command_buffer_cmd_emitter=1 \
      $PY scripts/xla_cmdbuf_vlog.py $keep > /dev/null 2> "$OUT/vlog$keep.txt"
    awk '/=== MARK/{m=$0} !/=== MARK/{ if (m != "") { sub(/^[IWE][0-9]+ [0-9:.]+ +[0-9]+ /, ""); gsub(/0x[0-9a-f]+/, "P"); gsub(/[0-9]+/, "N"); print m " | " substr($0, 1, 160) } }' \
      "$OUT/vlog$keep.txt" | sort | uniq -c | sort -k2 | head -80 >> "$OUT/kprobe.txt"
  done
  tar czf "$OUT/vlog.tgz" -C "$OUT" vlog.txt vlog--keep.txt && rm -f "$OUT"/vlog*.txt
  XLA_FLAGS="" JAX_PLATFORMS=cuda $PY scripts/xla_chain_probe.py --sizes 1048576,4194304,16777216 \
    --algos one_shot,two_shot,ring >> "$OUT/kprobe.txt" 2>> "$OUT/build.log"
  log "probe rc=$?"
  cat "$OUT/kprobe.txt"
}

llcheck() {
  # one_shot over LL up to 256 KiB: correctness on every group size and dtype around the
  # limits, the timeout report on the LL path, kernel times; then the pipelining chunk at
  # 1 - 16 MiB (graph replay, the runtime's 512 KiB lanes).
  log "harness: one_shot around the LL limits (N = 2, 3, 4, 8)"
  $H --ranks 2,3,4,8 --counts 1,7,1000,16383,16384,32769,65535,65536,65537,131072 --algos one_shot \
    --dtypes f32,bf16,f16,i32,f64 --ops sum,max,min --iters 3 > "$OUT/harness_ll.log" 2>&1
  log "harness LL rc=$? $(tail -1 "$OUT/harness_ll.log")"
  grep FAIL "$OUT/harness_ll.log" | head -5
  $H --ranks 2 --counts 50000 --algos one_shot --dtypes f32 --ops sum --iters 1 --timeout-s 1 \
    --fault-rank 1 >> "$OUT/harness_ll.log" 2>&1
  log "LL fault rc=$? (3 expected): $(grep -m1 'timed out' "$OUT/harness_ll.log")"
  local G="--ranks 2 --dtypes f32 --ops sum --iters 1 --time-iters 1000 --time-graph 1 --lane-bytes 524288"
  $H $G --counts 1024,4096,16384,32768,65536 --algos one_shot | grep -E "^time|FAIL" | tee -a "$OUT/summary.txt"
  log "pipelining chunk 16/32/64/512 KiB at 1 - 16 MiB"
  for c in 16384 32768 65536 524288; do
    $H $G --counts 262144,1048576,4194304 --algos two_shot,ring --chunk-bytes $c | grep -E "^time|FAIL" \
      | sed "s/^/chunk=$c /" | tee -a "$OUT/summary.txt"
  done
}

oneshot() {
  # one_shot pipelined in chunks (the reduction of chunk c overlaps the transfer of c+1):
  # correctness with several chunk sizes on every group size, then kernel times (graph replay)
  # against the chunk, 256 KiB (non-LL lanes) to 64 MiB.
  log "harness: one_shot with 4 KiB and 32 KiB chunks (N = 2, 3, 4, 8)"
  for c in 4096 32768; do
    $H --ranks 2,3,4,8 --counts 1000,65537,300001,1048576,4194305 --algos one_shot --ll-max-bytes 0 \
      --dtypes f32,bf16,f64,i32 --ops sum,max --iters 3 --one-shot-chunk-bytes $c > "$OUT/harness_os.log" 2>&1
    log "one_shot chunk=$c rc=$? $(tail -1 "$OUT/harness_os.log")"
    grep FAIL "$OUT/harness_os.log" | head -5
  done
  local G="--ranks 2 --dtypes f32 --ops sum --iters 1 --time-iters 500 --time-graph 1 --lane-bytes 524288"
  for c in 8192 16384 32768 65536 524288; do
    $H $G --counts 65536,262144,1048576,4194304,16777216 --algos one_shot --ll-max-bytes 0 --one-shot-chunk-bytes $c \
      | grep -E "^time|FAIL" | sed "s/^/os_chunk=$c /" | tee -a "$OUT/summary.txt"
  done
}

case "$MODE" in
  decompose) decompose ;;
  cmdprobe) cmdprobe ;;
  kprobe) kprobe ;;
  oneshot) oneshot; harness ;;
  final4)  # small sizes: auto with the shipped table against lax, then pure chains in XLA
    JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 4M -f 4 -d float32,bfloat16 -a auto,lax \
      -n 20 -w 5 -k 100 --quiet --json "$OUT/bench_auto_k100.json" > "$OUT/bench_auto_k100.txt" 2>> "$OUT/build.log"
    log "auto check rc=$?"
    JAX_PLATFORMS=cuda $PY scripts/xla_chain_probe.py --sizes 4096,65536,262144 --algos one_shot \
      > "$OUT/probe.txt" 2>> "$OUT/build.log"; log "probe rc=$?"; cat "$OUT/probe.txt" ;;
  turns)  # why six algorithms in turns slow jax_gin's small sizes: XLA's command-buffer log
    for algos in auto,lax auto,one_shot,two_shot,ring,tree,lax; do
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 JAX_PLATFORMS=cuda $PY -m jax_gin.bench \
        -b 4K -e 16K -f 4 -d float32 -a $algos -n 10 -w 3 -k 100 --quiet > "$OUT/turns_$(echo $algos | tr , _).txt" 2> "$OUT/vlog.txt"
      echo "# $algos: $(grep -c 'Initialized command buffer' "$OUT/vlog.txt") initializations," \
        "$(grep -c 'Updated command buffer' "$OUT/vlog.txt") updates, $(grep -c 'Evict' "$OUT/vlog.txt") evictions" | tee -a "$OUT/summary.txt"
      grep -oE "(Initialized|Updated) command buffer.* in [0-9]+ [^ ]+ num_commands=[0-9]+" "$OUT/vlog.txt" \
        | sed -E 's/on device #[0-9]+ //' | awk '{n[$1" "$NF]++; t[$1" "$NF]+=$(NF-2)} END {for (k in n) print "  ", k, n[k], "calls, mean", t[k]/n[k], "us"}' | tee -a "$OUT/summary.txt"
      grep -E "^ +[0-9]" "$OUT/turns_$(echo $algos | tr , _).txt" | tee -a "$OUT/summary.txt"
    done; rm -f "$OUT/vlog.txt" ;;
  gpytest) PYTEST_FILES="tests/test_gpu.py tests/test_parity.py tests/test_rules.py tests/test_gpu_init_timeout.py" tests ;;
  record4) BENCH_ITERS=15 bench; BENCH_2PROC=0 multiproc ;;  # chain: 100 up to 4 MiB, 20 above (bench default)
  llcheck) llcheck; harness; sanitizer
    PYTEST_FILES="tests/test_gpu.py tests/test_parity.py tests/test_rules.py tests/test_gpu_init_timeout.py" tests ;;
  smallrec) smallrec ;;
  autocheck)  # auto with the rebuilt table against lax and one_shot, small sizes, chain of 100
    JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 4K -e 4M -f 4 -d float32,bfloat16 -a auto,one_shot,lax \
      -n 20 -w 5 -k 100 --quiet --json "$OUT/bench_auto_k100.json" > "$OUT/bench_auto_k100.txt" 2>> "$OUT/build.log"
    log "auto check rc=$?" ;;
  final3) multiproc; small_steps ;;
  record2) record2 ;;
  lanes) lanes ;;
  validate) lanes132; harness; sanitizer; PYTEST_FILES="tests/test_gpu.py tests/test_parity.py tests/test_rules.py tests/test_gpu_init_timeout.py" tests ;;
  ceiling) ceiling ;;
  x2) x2 ;;
  final2) harness; BENCH_2PROC=0 multiproc; BENCH_DTYPES=float32 bench ;;  # after kernel changes, on 2 GPUs
  single) harness
    PYTEST_FILES="tests/test_gpu.py tests/test_gpu_init_timeout.py tests/test_rules.py" PYTEST_TIMEOUT=240 tests
    single_timing; sanitizer ;;
  quick) harness; PYTEST_K="parity_1d and float32" tests; BENCH_MAX=64M bench ;;
  latency) latency ;;
  mlp)  # issue 4: many small all-reduces in one jit, command buffers off and on, both libraries
    JAX_PLATFORMS=cuda $PY -m jax_gin.bench_mlp --cmdbuf both --json "$OUT/bench_mlp.json" \
      > "$OUT/bench_mlp.txt" 2>> "$OUT/build.log"; log "bench_mlp rc=$?"; cat "$OUT/bench_mlp.txt" ;;
  llsweep)  # where does the LL protocol stop paying? (JAX_GIN_LL_MAX_BYTES)
    $H --ranks 2,4 --counts 16384,40000,65536 --dtypes f32,bf16 --algos one_shot --ll-max-bytes 262144 --iters 3 \
      > "$OUT/harness.log" 2>&1; log "harness LL<=256K: $(tail -1 "$OUT/harness.log")"
    for ll in 65536 262144; do
      JAX_GIN_LL_MAX_BYTES=$ll JAX_PLATFORMS=cuda $PY -m jax_gin.bench -b 64K -e 1M -f 2 -d float32 \
        -a one_shot,lax -n 50 -w 5 -k 20 > "$OUT/bench_ll_$ll.txt" 2>> "$OUT/build.log"
      log "ll_max=$ll"; grep -E "^ +[0-9]" "$OUT/bench_ll_$ll.txt" | tee -a "$OUT/summary.txt"
    done ;;
  small) harness; latency; sanitizer; PYTEST_K="parity or gpu or rules" tests; BENCH_MAX=4M BENCH_ITERS=50 bench; graphs ;;
  tests) harness; sanitizer; tests ;;
  bench) bench ;;
  full) harness; sanitizer; tests; bench; graphs ;;
  graphs) graphs ;;
  multiproc) multiproc ;;
  gin) harness_gin ;;
  pytest) tests ;;
  record) tests; bench; graphs ;;
esac
log "done"
cat "$OUT/summary.txt"
for f in "$OUT"/bench*.txt; do [ -f "$f" ] && { echo "--- $f"; grep -E "^ +[0-9]|Avg|Geomean" "$f" | head -120; }; done
