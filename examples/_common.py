"""Shared by the examples: the choice of devices (GPUs when jax_gin has its CUDA build and a
GPU is present, otherwise 8 CPU devices; must run before JAX initializes its backends), and
timing."""
import os


def default_to_cpu_devices(count: int = 8) -> None:
    if "JAX_PLATFORMS" not in os.environ and not os.environ.get("JAX_GIN_DEMO_GPU"):
        try:
            import jax_gin._native as _n
            has_gpu = _n.has_cuda() and os.path.exists("/dev/nvidia0")
        except Exception:
            has_gpu = False
        if not has_gpu:
            os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" and "device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (findings.md)


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


def workload_parser(description: str):
    """The options of the step examples (dp_train, tp_train, tp_decode): which all-reduce,
    the sizes (None: the workload's defaults for the platform), steps and timing rounds."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--reduce", choices=("all", "jax_gin", "lax", "none"), default="all",
                   help="the all-reduce of the step: jax_gin.psum, lax.psum or none (compute "
                        "only); 'all' times the three in turns (default)")
    p.add_argument("--algorithm", default="auto", help="jax_gin's algorithm (default auto)")
    p.add_argument("--layers", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", "--tokens", type=int, dest="batch")
    p.add_argument("--steps", type=int, default=3, help="steps run before the timing")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    return p


def workload_setup(workload: str, description: str):
    """(args, mesh, cfg, reduce) of a step example: its options parsed, the workload's 1-D mesh
    over every device, its sizes (the platform's defaults unless given) and the all-reduce its
    steps run with ('all' runs jax_gin's, then times the three)."""
    import jax
    from jax_gin import workloads

    args = workload_parser(description).parse_args()
    devices = jax.devices()
    mesh = workloads.make_mesh(workload, devices)
    cfg = workloads.default_config(workload, devices[0].platform, layers=args.layers,
                                   d_model=args.d_model, seq=args.seq, batch=args.batch)
    reduce = "jax_gin" if args.reduce == "all" else args.reduce
    print(f"{workload} on {len(devices)} x {devices[0].device_kind}: {cfg}")
    return args, mesh, cfg, reduce


def report_step_times(workload: str, mesh, cfg, args) -> None:
    """Times the step built with args.reduce (or all three) in turns with the compute-only
    one, and prints the step times and the exposed communication."""
    from jax_gin import workloads

    chosen = workloads.REDUCES if args.reduce == "all" else \
        tuple(dict.fromkeys(("none", args.reduce)))
    result = workloads.measure(workload, mesh, cfg, algorithm=args.algorithm, reduces=chosen,
                               rounds=args.rounds)
    print()
    print("\n".join(workloads.format_report(result)))
