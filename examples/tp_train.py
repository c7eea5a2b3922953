"""Megatron tensor-parallel training step with jax_gin.psum.

    python examples/tp_train.py                   # jax_gin, lax and compute only, timed in turns
    python examples/tp_train.py --reduce jax_gin  # jax_gin, and compute only for the exposed time

Each block's QKV and MLP-up weights are split by columns over the mesh axis "tensor", its
attention-out and MLP-down weights by rows. Every device computes its heads and its share of
the MLP, and a psum after each row-parallel matmul sums the partial products. The block, as
jax_gin.workloads.megatron_block writes it (psum = jax_gin.psum):

    q, k, v = jnp.einsum("bsd,dthe->tbshe", norm(x), p["qkv"])       # column-parallel
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + psum(jnp.einsum("bshe,hed->bsd", a, p["o"]), "tensor")    # row-parallel
    h = jax.nn.gelu(norm(x) @ p["up"])                                 # column-parallel
    x = x + psum(h @ p["down"], "tensor")                              # row-parallel

jax.value_and_grad of the blocks, inside shard_map with check_vma=False, transposes each
psum into another psum: 2 all-reduces per block forward and 2 backward, all by jax_gin
(workloads.tp_train_step says why check_vma=False, and why the loss is divided by n).

Sizes default to 16 layers, d_model 4096, 1024 tokens on GPUs and to a tiny model on CPU
devices.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import default_to_cpu_devices, report_step_times, workload_setup  # noqa: E402

default_to_cpu_devices()  # 8 CPU devices unless a GPU and the CUDA build are present

from jax_gin import workloads  # noqa: E402


def main():
    args, mesh, cfg, reduce = workload_setup("tp-train", __doc__.splitlines()[0])

    blocks, x, y = workloads.tp_train_inputs(mesh, cfg)
    step = workloads.tp_train_step(mesh, cfg, reduce=reduce, algorithm=args.algorithm)
    for i in range(args.steps):
        blocks, loss = step(blocks, x, y)
        print(f"step {i} ({reduce}): loss {float(loss):.4f}")

    report_step_times("tp-train", mesh, cfg, args)


if __name__ == "__main__":
    main()
