"""Many small all-reduces in one jit: a tensor-parallel MLP of L layers, one psum per layer.

    python -m jax_gin.bench_mlp                       # 24 layers, XLA's default flags
    python -m jax_gin.bench_mlp --cmdbuf both         # command buffers (CUDA graphs) off and on

Each layer is h <- psum(relu(h @ w1) @ w2, "tp") with w1 column-parallel and w2 row-parallel
over the mesh axis "tp" (Megatron layout), so one forward step holds L dependent
all-reduces of batch x d_model elements: the latency-bound regime where launch cost and CUDA
graphs decide. The step runs with jax_gin.psum and with lax.psum, on the same inputs, and
the results are compared bit for bit (inputs are small integers on a 1/64 grid, so every sum
is exact). Reported: median time per step and per layer.

With --cmdbuf both|on|off the measurement runs in child processes, because XLA reads its flags
once per process: "off" sets --xla_gpu_enable_command_buffer= (empty), "on" forces
FUSION,CUBLAS,CUSTOM_CALL,COLLECTIVES with --xla_gpu_graph_min_graph_size=1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CMDBUF_FLAGS = {
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "on": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,COLLECTIVES "
          "--xla_gpu_graph_min_graph_size=1",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_gin.bench_mlp", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--algorithm", default="auto", help="jax_gin algorithm (default auto)")
    p.add_argument("-n", "--iters", type=int, default=50)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--devices", type=int, default=None, help="use the first N devices")
    p.add_argument("--cmdbuf", choices=("default", "off", "on", "both"), default="default")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def measure(args) -> dict:
    """One process, the flags already set: time both libraries, check they agree."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_gin

    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    if args.hidden % n:
        raise SystemExit(f"--hidden {args.hidden} must be a multiple of the {n} devices")
    rng = np.random.default_rng(0)

    def grid(shape, scale):  # small integers / 64: sums of these stay exact in float32
        return (rng.integers(-scale, scale + 1, size=shape) / 64.0).astype(np.float32)

    x = jnp.asarray(grid((args.batch, args.d_model), 2))
    w1 = jax.device_put(grid((args.layers, args.d_model, args.hidden), 1),
                        NamedSharding(mesh, P(None, None, "tp")))
    w2 = jax.device_put(grid((args.layers, args.hidden, args.d_model), 1),
                        NamedSharding(mesh, P(None, "tp", None)))

    def make(psum):
        def body(x, w1, w2):
            h = x
            for layer in range(args.layers):
                a = jax.nn.relu(h @ w1[layer])        # column-parallel: local columns
                h = psum(a @ w2[layer], "tp")          # row-parallel: sum partial products
                h = jnp.clip(h, -4.0, 4.0)             # keep values bounded (and exact)
                h = jnp.round(h * 64.0) / 64.0
            return h
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, None, "tp"),
                                                                P(None, "tp", None)),
                                     out_specs=P(), check_vma=False))

    fns = {"jax_gin": make(lambda v, a: jax_gin.psum(v, a, algorithm=args.algorithm)),
           "lax": make(jax.lax.psum)}
    outs, times = {}, {}
    for name, f in fns.items():
        outs[name] = np.asarray(jax.block_until_ready(f(x, w1, w2)))
        for _ in range(args.warmup):
            jax.block_until_ready(f(x, w1, w2))
        t = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w1, w2))
            t.append(time.perf_counter() - t0)
        times[name] = float(np.median(t)) * 1e6
    same = bool(np.array_equal(outs["jax_gin"].view(np.uint8), outs["lax"].view(np.uint8)))
    return {
        "platform": devices[0].platform, "device_kind": devices[0].device_kind, "ndevices": n,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": args.layers, "batch": args.batch,
        "d_model": args.d_model, "hidden": args.hidden, "algorithm": args.algorithm,
        "psum_bytes": args.batch * args.d_model * 4,
        "step_us": times, "layer_us": {k: v / args.layers for k, v in times.items()},
        "speedup": times["lax"] / times["jax_gin"], "bitwise_equal": same,
        "jax": jax.__version__,
    }


def print_result(r: dict, label: str) -> None:
    print(f"# {label}: {r['ndevices']} x {r['device_kind']} ({r['platform']}), jax {r['jax']}, "
          f"{r['layers']} layers, psum of {r['psum_bytes']} B per layer, XLA_FLAGS='{r['xla_flags']}'")
    for name in ("jax_gin", "lax"):
        print(f"  {name:<8} {r['step_us'][name]:>10.1f} us/step {r['layer_us'][name]:>8.2f} us/layer")
    print(f"  speed-up (lax / jax_gin): {r['speedup']:.2f}x   bitwise equal: {r['bitwise_equal']}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast must stay off
    modes = ("off", "on") if args.cmdbuf == "both" else (args.cmdbuf,)
    if args.cmdbuf == "default" and "JAX_GIN_BENCH_MLP_CHILD" not in os.environ:
        results = {"default": measure(args)}
    else:
        results = {}
        for mode in modes:
            if os.environ.get("JAX_GIN_BENCH_MLP_CHILD") == mode:
                results[mode] = measure(args)
                continue
            # XLA reads its flags once per process: measure each setting in a child.
            env = dict(os.environ, JAX_GIN_BENCH_MLP_CHILD=mode,
                       XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + CMDBUF_FLAGS[mode]).strip())
            child = [sys.executable, "-m", "jax_gin.bench_mlp",
                     *(argv if argv is not None else sys.argv[1:]), "--cmdbuf", mode]
            out = subprocess.run(child, env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if os.environ.get("JAX_GIN_BENCH_MLP_CHILD"):
        print(json.dumps(next(iter(results.values()))))
        return 0
    for mode, r in results.items():
        print_result(r, f"command buffers: {mode}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["bitwise_equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
