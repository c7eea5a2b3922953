"""Data-parallel GPT-style training step with jax_gin.psum.

    python examples/dp_train.py                   # jax_gin, lax and compute only, timed in turns
    python examples/dp_train.py --reduce jax_gin  # jax_gin, and compute only for the exposed time

Every device holds all the parameters and its shard of the batch; it computes the gradients
of its shard, and one call all-reduces the whole gradient pytree. The step, as
jax_gin.workloads.dp_train_step writes it:

    def step(params, tokens):
        loss, grads = jax.value_and_grad(gpt_loss)(params, tokens, heads)
        grads = jax_gin.psum(grads, "data")      # in place of jax.lax.psum(grads, "data")
        return sgd(params, grads, lr / n), loss

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                                 out_specs=(P(), P("data")), check_vma=False))

Sizes default to 12 layers, d_model 1024 on GPUs and to a tiny model on CPU devices. There,
`auto` hands the tiny model's one gradient call (212.6 KiB) to XLA's all-reduce, as the CPU
tuning table says (above 32 KiB), so the jax_gin row runs XLA's all-reduce; --algorithm
ring, tree, one_shot or two_shot runs jax_gin's.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import default_to_cpu_devices, report_step_times, workload_setup  # noqa: E402

default_to_cpu_devices()  # 8 CPU devices unless a GPU and the CUDA build are present

from jax_gin import workloads  # noqa: E402


def main():
    args, mesh, cfg, reduce = workload_setup("dp-train", __doc__.splitlines()[0])

    params, tokens = workloads.dp_train_inputs(mesh, cfg)
    step = workloads.dp_train_step(mesh, cfg, reduce=reduce, algorithm=args.algorithm)
    for i in range(args.steps):
        params, losses = step(params, tokens)   # losses: one per device
        print(f"step {i} ({reduce}): mean loss {float(losses.mean()):.4f}")

    report_step_times("dp-train", mesh, cfg, args)


if __name__ == "__main__":
    main()
