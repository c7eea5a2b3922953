"""jax_gin demo: one data-parallel training step with jax_gin.psum, checked against lax.psum.

    python examples/demo.py            # the devices present; 8 CPU devices when there is no GPU

A small MLP is trained data-parallel over a 1-D mesh: each device computes the gradient of
its shard of the batch, and the gradients are all-reduced. The step runs with jax_gin.psum
and with jax.lax.psum, and the demo prints the losses and the time per step of each, whether
they all-reduce the same per-device gradients to the same bits, and how far apart the
parameters are after 5 steps. Where auto gives the gradients to XLA's own all-reduce (8 CPU
devices do at their size), jax_gin's two_shot runs too, so that one of jax_gin's own
all-reduces is checked.
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import default_to_cpu_devices, median_us  # noqa: E402

default_to_cpu_devices()  # 8 CPU devices unless a GPU and the CUDA build are present

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_gin  # noqa: E402


def init(key, sizes):
    params = []
    for din, dout in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        # weights on a 1/64 grid: gradients of this small problem stay exactly representable
        w = jnp.round(jax.random.normal(k, (din, dout)) * 8) / 64
        params.append((w, jnp.zeros((dout,))))
    return params


def loss_fn(params, x, y):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


def make_step(mesh, allreduce, n):
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = allreduce(grads, "data")            # the all-reduce under test
        loss = allreduce(loss, "data") / n
        params = jax.tree.map(lambda p, g: p - 0.05 * g / n, params, grads)
        return params, loss

    spec_p = P()
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec_p, P("data"), P("data")),
                                 out_specs=(spec_p, spec_p)))


def local_grads(mesh):
    """Each device's gradient of its shard of the batch, stacked along the mesh axis, on a
    1/1024 grid: sums of such values are exact in any order, so every correct all-reduce
    gives the same bits (XLA's may add in another order than jax_gin's)."""
    def grads(params, x, y):
        return jax.tree.map(lambda g: (jnp.round(g * 1024) / 1024)[None],
                            jax.grad(loss_fn)(params, x, y))

    return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=P("data")))


def all_reduce(mesh, allreduce):
    """The all-reduce alone, over stacked per-device gradients."""
    def f(g):
        return allreduce(jax.tree.map(lambda a: a[0], g), "data")

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    print(f"jax_gin {jax_gin.__version__} demo: {n} x {devices[0].device_kind} "
          f"({jax.default_backend()}), jax {jax.__version__}")
    params = init(jax.random.PRNGKey(0), [64, 256, 256, 16])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-2, 3, size=(n * 16, 64)).astype(np.float32))
    y = jnp.asarray(rng.integers(-2, 3, size=(n * 16, 16)).astype(np.float32))

    rows = []
    grads = local_grads(mesh)(params, x, y)
    # What auto runs for the gradients (one call: a dtype, under the bucket size). Where its
    # tuning table gives them to XLA's own all-reduce (8 CPU devices do, above 32 KiB), the
    # demo also runs jax_gin's two_shot, so that jax_gin's own all-reduce is the one checked.
    auto = jax_gin.explain(jax.tree.map(lambda g: g[0], grads), nranks=n)
    variants = [("jax_gin.psum", jax_gin.psum)]
    if n > 1 and auto.startswith("xla"):
        variants.append(("jax_gin two_shot", functools.partial(jax_gin.psum, algorithm="two_shot")))
    reduced, results = {}, {}
    for name, fn in variants + [("lax.psum", jax.lax.psum)]:
        reduced[name] = [np.asarray(a) for a in jax.tree.leaves(all_reduce(mesh, fn)(grads))]
        step = make_step(mesh, fn, n)
        p, losses = params, []
        for _ in range(5):
            p, loss = step(p, x, y)
            losses.append(float(loss))
        results[name] = [np.asarray(a) for a in jax.tree.leaves(p)]
        rows.append((name, losses[0], losses[-1], median_us(step, params, x, y)))

    lax_sums, lax_params = reduced.pop("lax.psum"), results.pop("lax.psum")
    same_sums = all(np.array_equal(a, b) for r in reduced.values() for a, b in zip(r, lax_sums))
    # Inside a step, XLA may fuse the arithmetic around a custom call differently than around
    # its own all-reduce, so the parameters after several inexact updates may differ in the
    # last bits.
    diff = max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
               for r in results.values() for a, b in zip(r, lax_params))
    print(f"\n{'all-reduce':<16} {'loss step 1':>12} {'loss step 5':>12} {'us/step':>10}")
    for name, l0, l4, us in rows:
        print(f"{name:<16} {l0:>12.6f} {l4:>12.6f} {us:>10.1f}")
    if n == 1:
        print("(one device: a group of one rank, where lax.psum and jax_gin.psum both return "
              "their input and no all-reduce runs)")
    ours = ", ".join(name for name, _ in variants)
    print(f"\nthe same per-device gradients all-reduced, bitwise equal: {same_sums} ({ours} "
          "against lax.psum)")
    print("parameters after 5 steps: " + ("bitwise equal" if diff == 0 else
          f"max difference {diff:.1e} of the largest (XLA fuses the update differently)"))
    print(f"auto (jax_gin.psum) for the gradients: {auto}")
    return 0 if same_sums and diff < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
