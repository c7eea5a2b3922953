"""Fully sharded data-parallel (FSDP) GPT training step with jax_gin.all_gather.

    python examples/fsdp.py                   # jax_gin, lax and compute only, timed in turns
    python examples/fsdp.py --reduce jax_gin  # jax_gin, and compute only for the exposed time

dp_train.py's model and batch, but no device holds the whole model: the parameters of each
block are one flat vector split over the mesh axis "data", each device holding 1/n of it (one
more vector holds the embeddings and the final norm). The loss gathers a block's parameters
right before the block, and the gradient is taken with respect to the shards, so jax.grad
turns every all-gather into a reduce-scatter of the gradients: jax_gin.all_gather's
transpose is jax_gin.psum_scatter, as lax.all_gather's is lax.psum_scatter. Each device
updates its own 1/n. The step, as jax_gin.workloads.fsdp_train_step writes it
(gather = jax_gin.all_gather):

    def loss(shards, tokens):
        top = unpack(gather(shards["top"], "data", axis=0, tiled=True))
        x = gpt_embed(top, tokens)
        for shard in shards["layers"]:
            p = unpack(gather(shard, "data", axis=0, tiled=True))  # in place of jax.lax.all_gather
            x = gpt_block(x, p, heads)
        return gpt_head(x, top, tokens)

    def step(shards, tokens):
        loss, grads = jax.value_and_grad(loss)(shards, tokens)    # grads: reduce-scattered
        return sgd(shards, grads, lr / n), loss

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                                 out_specs=(P("data"), P("data")), check_vma=False))

--reduce picks the collectives (jax_gin's or lax's all_gather and psum_scatter, or none: local
copies and slices of the same shapes, compute only), --algorithm jax_gin's (auto, one_shot or
ring). Sizes default to dp_train.py's: 12 layers, d_model 1024 on GPUs and a tiny model on
CPU devices.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import default_to_cpu_devices, report_step_times, workload_setup  # noqa: E402

default_to_cpu_devices()  # 8 CPU devices unless a GPU and the CUDA build are present

from jax_gin import workloads  # noqa: E402


def main():
    args, mesh, cfg, reduce = workload_setup("fsdp", __doc__.splitlines()[0])

    shards, tokens = workloads.fsdp_inputs(mesh, cfg)
    step = workloads.fsdp_train_step(mesh, cfg, reduce=reduce, algorithm=args.algorithm)
    for i in range(args.steps):
        shards, losses = step(shards, tokens)   # losses: one per device
        print(f"step {i} ({reduce}): mean loss {float(losses.mean()):.4f}")

    report_step_times("fsdp", mesh, cfg, args)


if __name__ == "__main__":
    main()
