"""Tensor-parallel MLP training step in global view (jit), with jax_gin.matmul vs jnp.

    python examples/tp_mlp.py            # the devices present; 8 CPU devices when there is no GPU
    python examples/tp_mlp.py --batch 256 --d-model 1024 --hidden 4096 --iters 50   # bigger, for GPUs

A two-layer MLP without biases, y = relu(x @ w1) @ w2, is trained on a data x tensor mesh
in the Megatron layout:
- x and y are sharded over "data" by rows;
- w1 is column-parallel, sharded over "tensor" by columns;
- w2 is row-parallel, sharded over "tensor" by rows.

The step is written in global view: plain jit on sharded arrays, no shard_map. The
partitioner finds the all-reduces:
- the forward of the row-parallel layer sums partial products over "tensor";
- the loss (a mean over the batch) and both weight gradients sum over "data".

In the jax_gin version, jax_gin.matmul and jax_gin.mean make every one of these a jax_gin
custom call. In the jnp version, with jnp.matmul and jnp.mean, XLA inserts its own
all-reduces. The example runs 5 steps of each, compares the losses and the gradients, counts
the collectives in the compiled steps and times both.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import default_to_cpu_devices, median_us  # noqa: E402

default_to_cpu_devices()  # 8 CPU devices unless a GPU and the CUDA build are present

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_gin  # noqa: E402

LR = 0.05
VERSIONS = {"jax_gin": (jax_gin.matmul, jax_gin.mean), "jnp": (jnp.matmul, jnp.mean)}


def make_mesh(devices=None):
    """data x tensor: 2 x n/2 for an even n >= 4 (2 x 4 on 8 CPUs), else 1 x n (1 x 2 on 2 GPUs)."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    shape = (2, n // 2) if n >= 4 and n % 2 == 0 else (1, n)
    return jax.make_mesh(shape, ("data", "tensor"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def init(mesh, batch, d_model, hidden, seed=0):
    """Parameters and data, sharded. Values lie on coarse grids (integers, 1/64), so the
    products are exact and the versions differ only by the order of their sums."""
    rng = np.random.default_rng(seed)
    w1 = np.round(rng.normal(size=(d_model, hidden)) * 8) / 64
    w2 = np.round(rng.normal(size=(hidden, d_model)) * 8) / 64
    x = rng.integers(-2, 3, size=(batch, d_model))
    y = rng.integers(-2, 3, size=(batch, d_model))

    def put(a, spec):
        return jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, spec))

    params = (put(w1, P(None, "tensor")), put(w2, P("tensor", None)))
    return params, put(x, P("data", None)), put(y, P("data", None))


def make_step(matmul, mean):
    def loss_fn(params, x, y):
        w1, w2 = params
        h = jax.nn.relu(matmul(x, w1))  # column-parallel: no collective
        out = matmul(h, w2)  # row-parallel: all-reduce over "tensor"
        return mean((out - y) ** 2)  # all-reduce over "data"

    @jax.jit
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # dw: all-reduce over "data"
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return params, loss, grads

    return step


def collectives(step, *args):
    """(jax_gin custom calls, XLA all-reduces) in the compiled step."""
    text = step.lower(*args).compile().as_text()
    ours = text.count('custom_call_target="jax_gin_all_reduce')
    xla = sum(1 for line in text.splitlines()
              if " all-reduce(" in line or " all-reduce-start(" in line)
    return ours, xla


def run(mesh=None, batch=32, d_model=64, hidden=256, steps=5, iters=20):
    """Train `steps` steps with each version. Returns a dict of results per version, and
    the maximum relative difference of the losses and of the gradients at every step."""
    mesh = mesh if mesh is not None else make_mesh()
    params0, x, y = init(mesh, batch, d_model, hidden)
    results = {}
    for name, (matmul, mean) in VERSIONS.items():
        step = make_step(matmul, mean)
        params, losses, grads = params0, [], []
        for _ in range(steps):
            params, loss, g = step(params, x, y)
            losses.append(np.asarray(loss))
            grads.append([np.asarray(a) for a in g])
        results[name] = dict(losses=losses, grads=grads, params=[np.asarray(p) for p in params],
                             collectives=collectives(step, params0, x, y),
                             us=median_us(step, params0, x, y, iters=iters) if iters else float("nan"))

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    ours, ref = results["jax_gin"], results["jnp"]
    loss_diff = max(rel(a, b) for a, b in zip(ours["losses"], ref["losses"]))
    grad_diff = max(rel(a, b) for ga, gb in zip(ours["grads"], ref["grads"]) for a, b in zip(ga, gb))
    bitwise = (all(np.array_equal(a, b) for a, b in zip(ours["losses"], ref["losses"])) and
               all(np.array_equal(a, b) for ga, gb in zip(ours["grads"], ref["grads"])
                   for a, b in zip(ga, gb)))
    return results, loss_diff, grad_diff, bitwise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32,
                    help="rows of x and y, split over 'data': a multiple of its size "
                         "(default %(default)s)")
    ap.add_argument("--d-model", type=int, default=64,
                    help="columns of x and y, rows of w1 (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=256,
                    help="columns of w1 and rows of w2, split over 'tensor': a multiple of its "
                         "size (default %(default)s)")
    ap.add_argument("--steps", type=int, default=5,
                    help="training steps of each version, compared (default %(default)s)")
    ap.add_argument("--iters", type=int, default=20,
                    help="timed steps of each version, whose median is printed (default "
                         "%(default)s)")
    args = ap.parse_args(argv)
    mesh = make_mesh()
    if min(args.batch, args.d_model, args.hidden, args.steps, args.iters) < 1:
        ap.error("--batch, --d-model, --hidden, --steps and --iters must be at least 1")
    data, tensor = mesh.shape["data"], mesh.shape["tensor"]
    if args.batch % data or args.hidden % tensor:
        ap.error(f"the mesh is data {data} x tensor {tensor}: --batch ({args.batch}) must be a "
                 f"multiple of {data} and --hidden ({args.hidden}) of {tensor}")
    devices = jax.devices()
    print(f"jax_gin {jax_gin.__version__} tensor-parallel MLP: {len(devices)} x "
          f"{devices[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, mesh "
          f"{dict(mesh.shape)}; batch {args.batch}, d_model {args.d_model}, hidden {args.hidden}")
    results, loss_diff, grad_diff, bitwise = run(mesh, args.batch, args.d_model, args.hidden,
                                                 args.steps, args.iters)
    print(f"\n{'version':<10} {'loss step 1':>12} {'loss step ' + str(args.steps):>12} "
          f"{'us/step':>10} {'jax_gin calls':>14} {'XLA all-reduces':>16}")
    for name, r in results.items():
        ours, xla = r["collectives"]
        print(f"{name:<10} {float(r['losses'][0]):>12.6f} {float(r['losses'][-1]):>12.6f} "
              f"{r['us']:>10.1f} {ours:>14} {xla:>16}")
    print(f"\nlosses and gradients over {args.steps} steps: bitwise equal: {bitwise}; "
          f"max relative difference: loss {loss_diff:.2e}, gradients {grad_diff:.2e}")
    ok = loss_diff <= 1e-5 and grad_diff <= 1e-5 and results["jax_gin"]["collectives"][1] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
