"""What XLA's command-buffer thunk does on each execution of a chain of jax_gin calls:
run with TF_CPP_VMODULE set for XLA's command-buffer files; markers on stderr separate the
executions, so the log shows whether each call replays the graph or records it again.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=3 \
        python scripts/xla_cmdbuf_vlog.py [--k 10] [--bytes 16384] [--keep]
"""
import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from xla_chain_probe import pure_chain  # noqa: E402

from jax_gin import bench  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--bytes", type=int, default=16384)
    p.add_argument("--keep", action="store_true", help="keep every output alive (new addresses)")
    a = p.parse_args()
    devs = jax.devices()
    mesh = Mesh(np.array(devs), (bench.AXIS,))
    x = jax.device_put(jnp.ones((len(devs) * a.bytes // 4,), jnp.float32), NamedSharding(mesh, P(bench.AXIS)))
    f = pure_chain(mesh, "one_shot", a.k)
    kept = []
    for i in range(5):
        print(f"=== MARK execution {i}", file=sys.stderr, flush=True)
        out = jax.block_until_ready(f(x))
        if a.keep:
            kept.append(out)
    print("=== MARK end", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
