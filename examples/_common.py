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
