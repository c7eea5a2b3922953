"""Llama-shaped tensor-parallel decode step with jax_gin.psum.

    python examples/tp_decode.py                         # every variant, timed in turns
    python examples/tp_decode.py --reduce jax_gin        # jax_gin, and compute only for the exposed time
    python examples/tp_decode.py --reduce jax_gin_fused  # each psum, residual add and RMSNorm as
                                                         # one jax_gin.psum_add_rmsnorm

One new token per sequence goes through every block. The weights are split over the mesh
axis "tensor" as in Megatron (QKV, gate and up by columns, attention-out and down by rows),
and so is the cached context (by heads). Each block makes 2 small all-reduces, each followed
by the residual add and an RMSNorm; as jax_gin.workloads.llama_decode writes it
(psum = jax_gin.psum):

    q, k, v = jnp.einsum("bd,dthe->tbhe", h, p["qkv"])                 # column-parallel
    a = attend(q, cached keys and values + k, v)
    x = x + psum(jnp.einsum("bhe,hed->bd", a, p["o"]), "tensor")        # row-parallel
    h = norm(x, p["ln2"])
    m = jax.nn.silu(h @ p["gate"]) * (h @ p["up"])                       # column-parallel
    x = x + psum(m @ p["down"], "tensor")                                # row-parallel
    h = norm(x, next block's ln1)

With --reduce jax_gin_fused each psum, the residual add and the RMSNorm after it are one
jax_gin.psum_add_rmsnorm (on GPUs one kernel).
Sizes default to 32 layers, d_model 4096, 8 tokens (64 psums of 64 KiB) on GPUs and to a
tiny model on CPU devices.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import default_to_cpu_devices, report_step_times, workload_setup  # noqa: E402

default_to_cpu_devices()  # 8 CPU devices unless a GPU and the CUDA build are present

from jax_gin import workloads  # noqa: E402


def main():
    args, mesh, cfg, reduce = workload_setup("tp-decode", __doc__.splitlines()[0])

    params, cache, x = workloads.tp_decode_inputs(mesh, cfg)
    step = workloads.tp_decode_step(mesh, cfg, reduce=reduce, algorithm=args.algorithm)
    for i in range(args.steps):
        h = step(params, cache, x)   # the normed hidden states of the new tokens
        print(f"step {i} ({reduce}): hidden states {h.shape}, mean |h| {float(abs(h).mean()):.4f}")

    report_step_times("tp-decode", mesh, cfg, args)


if __name__ == "__main__":
    main()
