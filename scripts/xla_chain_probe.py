"""Where does per-op time go inside XLA at small sizes? Times chains of jax_gin all-reduces
with nothing between them (y <- psum(y), check_vma=False; exact: ones grow by N per op) next
to the benchmark's slice chain (y <- psum(y); y[0] <- x[0]), per op, the benchmark's way:
(median T_K - median T_1) / (K - 1). With nothing between the calls, a chain that XLA
captures into one command buffer (CUDA graph) runs at the kernels' own pace; one launched
op by op runs at the host's.

    python scripts/xla_chain_probe.py [--sizes 4096,65536,262144] [--k 100]

Only jax_gin can run the pure chain: XLA folds lax.psum of an already reduced value into a
multiplication (it knows the value is the same on every device), so lax gets the slice chain.
XLA reads XLA_FLAGS once per process: run it once per flag setting.
"""
import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_gin
from jax_gin import bench


def pure_chain(mesh, algorithm, k):
    def chain(x):
        y = x
        for _ in range(k):
            y = jax_gin.psum(y, bench.AXIS, algorithm=algorithm)
        return y
    spec = P(bench.AXIS)
    return jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def per_op(f1, fk, k, args, reps):
    """The benchmark's per-op time (µs) after 5 warm-up calls, and the last outputs."""
    t1s, tks = [], []
    for i in range(5 + reps):
        t1, o1 = bench.time_call(f1, args)
        tk, ok = bench.time_call(fk, args)
        if i >= 5:
            t1s.append(t1)
            tks.append(tk)
    return (statistics.median(tks) - statistics.median(t1s)) / (k - 1) * 1e6, o1, ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,65536,262144")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--algos", default="one_shot,two_shot")
    a = p.parse_args()
    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), (bench.AXIS,))
    sh = NamedSharding(mesh, P(bench.AXIS))
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} devices={n} K={a.k}")
    for size in (int(s) for s in a.sizes.split(",")):
        count = size // 4
        ones = jax.device_put(jnp.ones((n * count,), jnp.float32), sh)
        for algo in a.algos.split(","):
            f1, fk = pure_chain(mesh, algo, 1), pure_chain(mesh, algo, a.k)
            us, o1, ok = per_op(f1, fk, a.k, (ones,), a.reps)
            good = bool(np.all(np.asarray(o1) == n)) and bool(np.all(np.asarray(ok) == float(n) ** a.k))
            print(f"pure  {algo:9s} {size:9d} B  {us:8.2f} us/op  exact={good}")
        x = bench.make_inputs(n, count, np.float32, "sum")
        dargs = (bench.put_global(x.x.reshape(-1), sh), bench.put_global(x.corr.reshape(-1), sh))
        for algo in a.algos.split(",") + ["lax"]:
            red = bench.reduce_fn("sum", algo)
            f1 = bench.build_chain(mesh, red, 1, "slice")
            fk = bench.build_chain(mesh, red, a.k, "slice")
            us, _, _ = per_op(f1, fk, a.k, dargs, a.reps)
            print(f"slice {algo:9s} {size:9d} B  {us:8.2f} us/op")


if __name__ == "__main__":
    main()
