"""Shared by the examples: the choice of devices (JAX_PLATFORMS where it is set; else GPUs when
jax_gin has its CUDA build and a GPU is present, otherwise 8 CPU devices; must run before JAX
initializes its backends), timing, and the options of the step examples."""
import os
import re


def default_to_cpu_devices(count: int = 8) -> None:
    if "JAX_PLATFORMS" not in os.environ:
        try:
            import jax_gin._native as _n
            has_gpu = _n.has_cuda() and os.path.exists("/dev/nvidia0")
        except Exception:
            has_gpu = False
        if not has_gpu:
            os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        # (XLA takes a flag's last value)
        given = re.findall(r"--xla_force_host_platform_device_count=(\d+)", flags)
        if not given:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
        from jax_gin import _runtime  # XLA's CPU threads for them (docs/debugging.md)
        _runtime.provide_xla_cpu_threads(int(given[-1]) if given else count)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (docs/multi-node.md)


def median_us(f, *args, iters: int = 20) -> float:
    """Median wall time of f(*args) in microseconds, after one untimed call (compilation)."""
    import time

    import jax
    import numpy as np

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


# lax's name of each XLA collective a workload's step makes (workloads.Workload.xla_ops)
_LAX_NAMES = {"all_reduce": "psum", "all_gather": "all_gather", "reduce_scatter": "psum_scatter"}


def workload_parser(workload: str, description: str):
    """The options of the step examples (dp_train, fsdp, tp_train, tp_decode) for `workload`:
    which collectives, jax_gin's algorithm, the sizes (None: the workload's defaults for the
    platform), steps and timing rounds."""
    import argparse

    from jax_gin import workloads

    w = workloads.WORKLOADS[workload]
    ops = " and ".join(_LAX_NAMES[op] for op in w.xla_ops)
    p = argparse.ArgumentParser(description=description)
    fused = (f", {workloads.FUSED} (jax_gin's psum fused with the residual add and RMSNorm "
             "after it)") if workloads.FUSED in w.variants else ""
    p.add_argument("--reduce", choices=("all",) + w.variants, default="all",
                   help=f"the collectives of the step: jax_gin's {ops}, lax's, or none "
                        f"(compute only, on tensors of the same shapes){fused}; 'all' times "
                        "them all in turns (default)")
    p.add_argument("--algorithm", choices=("auto",) + w.algorithms, default="auto",
                   help="jax_gin's algorithm (default auto)")
    decode = workload == "tp-decode"
    for flags, field, what in (
            (("--layers",), "layers", "blocks"),
            (("--d-model",), "d_model", "the model width"),
            (("--heads",), "heads", "attention heads; without it d_model // the default head "
                                    "size"),
            (("--seq",), "seq", "the cached context's length" if decode else "sequence length"),
            (("--batch", "--tokens"), "batch", "tokens decoded, one per sequence" if decode else
             "sequences" + ("" if w.tensor_parallel else " per device"))):
        p.add_argument(*flags, type=int, dest=field,
                       help=f"{what} (default {getattr(w.gpu, field)} on GPUs, "
                            f"{getattr(w.cpu, field)} on CPU devices)")
    p.add_argument("--steps", type=int, default=3, help="steps run before the timing (default 3)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    return p


def workload_setup(workload: str, description: str):
    """(args, mesh, cfg, reduce) of a step example: its options parsed, the workload's 1-D mesh
    over every device, its sizes (the platform's defaults unless given) and the all-reduce its
    steps run with ('all' runs jax_gin's, then times every variant of the workload)."""
    import jax
    from jax_gin import workloads

    parser = workload_parser(workload, description)
    args = parser.parse_args()
    if args.steps < 0 or args.rounds < 1:
        parser.error("--steps must be at least 0 and --rounds at least 1")
    devices = jax.devices()
    mesh = workloads.make_mesh(workload, devices)
    try:
        cfg = workloads.default_config(workload, devices[0].platform, layers=args.layers,
                                       d_model=args.d_model, heads=args.heads, seq=args.seq,
                                       batch=args.batch)
        workloads.check_config(workload, cfg, len(devices))
    except ValueError as e:
        parser.error(f"{e} (on {len(devices)} devices)")
    reduce = "jax_gin" if args.reduce == "all" else args.reduce
    print(f"{workload} on {len(devices)} x {devices[0].device_kind}: {cfg}")
    return args, mesh, cfg, reduce


def report_step_times(workload: str, mesh, cfg, args) -> None:
    """Times the step built with args.reduce (or every variant) in turns with the compute-only
    one, and prints the step times and the exposed communication."""
    from jax_gin import workloads

    chosen = workloads.WORKLOADS[workload].variants if args.reduce == "all" else \
        tuple(dict.fromkeys(("none", args.reduce)))
    result = workloads.measure(workload, mesh, cfg, algorithm=args.algorithm, reduces=chosen,
                               rounds=args.rounds)
    print()
    print("\n".join(workloads.format_report(result)))
