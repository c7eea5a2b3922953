"""What XLA makes of the benchmark's chain on this machine: the optimized HLO of a chain of
K dependent all-reduces (jax_gin one_shot and lax.psum): the operations of each step. Prints
a summary line per library; writes the HLO text to $OUT. Whether the program runs in command
buffers (CUDA graphs) is not visible here: XLA 0.11 forms them on the thunk sequence after the
HLO passes (see `gpu_run.sh cmdprobe`: XLA's verbose log and its thunk-sequence dump).

    python scripts/xla_chain_hlo.py [--k 10] [--bytes 16384]

XLA reads XLA_FLAGS once per process: run it once per flag setting.
"""
import argparse
import collections
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

from jax_gin import bench


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--bytes", type=int, default=16384)
    p.add_argument("--tag", default="default")
    a = p.parse_args()
    devs = jax.devices()
    mesh = Mesh(np.array(devs), (bench.AXIS,))
    n = len(devs)
    count = a.bytes // 4
    x = bench.put_global(np.ones((n * count,), np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(bench.AXIS)))
    out = os.environ.get("OUT", ".")
    for name in ("one_shot", "lax"):
        f = bench.build_chain(mesh, bench.reduce_fn("sum", name), a.k, step="slice")
        text = f.lower(x, x).compile().as_text()
        with open(os.path.join(out, f"hlo_{a.tag}_{name}.txt"), "w") as fh:
            fh.write(text)
        ops = collections.Counter()
        for line in text.splitlines():
            m = re.search(r"\s([a-z][a-z\-]*)\(", line.split("=", 1)[1]) if "=" in line else None
            if m:
                ops[m.group(1)] += 1
        print(f"{a.tag} {name}: k={a.k} bytes={a.bytes} ops={dict(ops.most_common(8))}")


if __name__ == "__main__":
    main()
