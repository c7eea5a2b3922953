"""jax_gin demo: one data-parallel training step with jax_gin.psum, checked against lax.psum.

    python examples/demo.py            # the devices present; 8 CPU devices when there is no GPU

A small MLP is trained data-parallel over a 1-D mesh: each device computes the gradient of
its shard of the batch, and the gradients are all-reduced. The step runs twice, once with
jax_gin.psum and once with jax.lax.psum, and the demo prints the losses, whether the updated
parameters are bitwise equal, and the time per step of each.
"""
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


def main():
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
    results = {}
    for name, fn in (("jax_gin.psum", jax_gin.psum), ("lax.psum", jax.lax.psum)):
        step = make_step(mesh, fn, n)
        p, losses = params, []
        for _ in range(5):
            p, loss = step(p, x, y)
            losses.append(float(loss))
        results[name] = p
        rows.append((name, losses[0], losses[-1], median_us(step, params, x, y)))

    same = all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(results["jax_gin.psum"]),
                                                      jax.tree.leaves(results["lax.psum"])))
    print(f"\n{'all-reduce':<14} {'loss step 1':>12} {'loss step 5':>12} {'us/step':>10}")
    for name, l0, l4, us in rows:
        print(f"{name:<14} {l0:>12.6f} {l4:>12.6f} {us:>10.1f}")
    print(f"\nparameters after 5 steps bitwise equal: {same}")
    print(f"auto picks for the gradients: "
          f"{jax_gin.explain(jax.ShapeDtypeStruct((256 * 256,), jnp.float32), nranks=n)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
