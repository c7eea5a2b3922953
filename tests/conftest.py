"""Test setup: 8 CPU devices by default, another count with
XLA_FLAGS=--xla_force_host_platform_device_count=N (tests that need more devices skip); the
same suite runs on GPUs with JAX_PLATFORMS=cuda. With fewer CPUs than 2 a device, PJRT_NPROC gives
XLA's CPU client 2 threads a device (jax_gin._runtime.provide_xla_cpu_threads)."""
import os
import re

_platform = os.environ.get("JAX_PLATFORMS", "cpu")
if _platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    from jax_gin import _runtime  # noqa: E402 (jax creates no backend at import)
    _count = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ["XLA_FLAGS"])
    _runtime.provide_xla_cpu_threads(int(_count.group(1)) if _count else 1)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (docs/multi-node.md)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


def ndev() -> int:
    return len(jax.devices())


def mesh_1d():
    return Mesh(np.array(jax.devices()), ("i",))


def needs_devices(n: int):
    """Skips the calling test where fewer than `n` devices are present."""
    if ndev() < n:
        pytest.skip(f"needs {n} or more devices, have {ndev()}")


def mesh_2d():
    n = ndev()
    if n < 4 or n % 2:
        pytest.skip(f"a 2-D mesh needs an even number >= 4 of devices, have {n}")
    return Mesh(np.array(jax.devices()).reshape(n // 2, 2), ("x", "y"))


@pytest.fixture(autouse=True)
def _faulty_communicators_end_with_their_test():
    """A communicator with an injected fault (settings.fault_rank) is cached under the settings
    that made it, and refused once it failed: another test that happens to use the same
    settings must not find it. After a test that made one, every communicator goes."""
    yield
    from jax_gin import _runtime
    if any(key[7] != -1 for key in _runtime._cache):  # the key's settings.fault_rank
        _runtime.reset()


@pytest.fixture
def platform():
    return jax.default_backend()


def table_group_sizes() -> list:
    """The group sizes the tuning-table fixtures write tables for: this mesh's and its
    sub-meshes' (a 2-D mesh's axes)."""
    return sorted({2, 4, 8, ndev()})


@pytest.fixture
def cpu_table_with_xla(tmp_path, monkeypatch):
    """A tuning table for this CPU mesh: one_shot up to 1 KiB, XLA's all-reduce above."""
    if ndev() < 2:
        pytest.skip("a tuning table decides only for groups of 2 or more devices")
    import json
    import jax_gin
    from jax_gin import _select, tune

    kind = jax.devices()[0].device_kind
    for n in table_group_sizes():
        table = {"device_kind": kind, "nranks": n, "measured": "2026-11-30", "entries": [
            {"max_bytes": 1024, "algorithm": "one_shot"}, {"max_bytes": 1 << 40, "algorithm": "xla"}]}
        (tmp_path / tune.table_name(kind, n)).write_text(json.dumps(table))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    _select.load_table.cache_clear()
    yield kind
    _select.load_table.cache_clear()
