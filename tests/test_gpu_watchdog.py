"""On GPUs, a timed-out wait traps its kernel, and XLA then reports only an opaque CUDA error.
jax_gin's watchdog thread prints jax_gin's own report (op, rank, peer, step, and the diagnosis
of who is behind) to stderr the moment the kernel records it, and says the process cannot
continue.

GPU only (2 or more GPUs and the CUDA extension); skipped elsewhere. The worker runs in a
subprocess, since the trap loses its CUDA context."""
import subprocess
import sys

import pytest

from multiproc import clean_env, gpu_count, tail

WORKER = r"""
import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_gin
jax_gin.runtime.settings.timeout_s = 2
jax_gin.runtime.settings.fault_rank = 1  # rank 1 drops its signals: its peers time out
mesh = Mesh(np.array(jax.devices()), ("i",))
f = jax.jit(jax.shard_map(lambda v: jax_gin.psum(v, "i", algorithm="one_shot"), mesh=mesh,
                          in_specs=P("i"), out_specs=P()))
try:
    jax.block_until_ready(f(np.ones(1024 * len(jax.devices()), np.float32)))
except Exception as e:
    print("RAISED", type(e).__name__, flush=True)
import os, time
time.sleep(0.5)
os._exit(0)
"""


def test_watchdog_reports_a_trapped_kernel():
    if gpu_count() < 2:
        pytest.skip("needs 2 or more GPUs")
    from jax_gin import _native
    if _native.cuda is None:
        pytest.skip("jax_gin was built without CUDA")
    r = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120,
                       env=clean_env(JAX_PLATFORMS="cuda"))
    out = r.stdout + r.stderr
    assert "RAISED" in out, tail(out)
    assert "jax_gin watchdog: jax_gin psum (one_shot) on GPU: rank 0 of group 0" in out, tail(out)
    assert "timed out waiting for peer 1" in out, tail(out)
    # the diagnosis, from every rank's state block read through the windows: rank 1 finished
    # the call (its peers' signals reached it), rank 0 waits for its lost ones
    assert ("diagnosis: rank 1 finished call #1 (psum, one_shot), but rank 0 still waits for "
            "it at step 0: its signals did not arrive") in out, tail(out)
    # rank 0's wait marked its state failed before the states were read (report_timeout)
    assert "last calls of group 0: rank 0: #1 psum/one_shot, failed waiting for rank 1" in out, \
        tail(out)
    assert "cannot continue" in out, tail(out)
