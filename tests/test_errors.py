"""Bad input gets a clear error that names the problem: at trace time, when a setting is read
or assigned, when explain is called."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, ndev, needs_devices
from helpers import assert_bitwise, exact_input, smap


def _trace(f, x):
    return smap(f, mesh_1d(), P("i")).trace(x)


def test_unknown_axis():
    x = exact_input((4,), ndev(), "float32")
    with pytest.raises(NameError, match=r"Found an unbound axis name: j\. To fix this, please call psum under `jax.shard_map`\. Axes in scope: 'i'"):
        _trace(lambda v: jax_gin.psum(v, "j"), x)


def test_unknown_axis_outside_shard_map():
    with pytest.raises(NameError, match=r"Found an unbound axis name: i\. To fix this, please call psum under `jax.shard_map`"):
        jax_gin.psum(jnp.ones(3), "i")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
def test_unsupported_dtype(dtype):
    x = jnp.zeros((ndev() * 2,), dtype)
    with pytest.raises(TypeError, match=rf"unsupported dtype {dtype}.*float32.*bfloat16.*complex64"):
        _trace(lambda v: jax_gin.psum(v, "i"), x)


def test_psum_overlapping_names_itself():
    x = jnp.zeros((ndev() * 2,), "int8")
    with pytest.raises(TypeError, match=r"jax_gin.psum_overlapping: unsupported dtype int8"):
        _trace(lambda v: jax_gin.psum_overlapping(v, "i", jnp.sin, v)[0], x)


@pytest.mark.parametrize("api", ["psum", "pmax", "pmin", "psum_scatter", "psum_overlapping"])
def test_prng_keys_are_not_reduced(api):
    # lax refuses them too (add/max of key<fry>); all_gather moves them (test_scatter_gather)
    keys = jax.random.split(jax.random.key(0), ndev() * 2)
    fn = {"psum_scatter": lambda k: jax_gin.psum_scatter(k, "i", tiled=True),
          "psum_overlapping": lambda k: jax_gin.psum_overlapping(k, "i", lambda: 0)[0]}.get(
        api, lambda k: getattr(jax_gin, api)(k, "i"))
    with pytest.raises(TypeError, match=rf"jax_gin.{api}: key<fry> is a PRNG key array"):
        _trace(fn, keys)


@pytest.mark.parametrize("api", ["psum", "pmax", "pmin", "psum_scatter", "all_gather"])
def test_axis_index_groups(api):
    # lax's keyword: None is lax's default and is accepted; groups are not supported
    n = ndev()
    x = exact_input((n,), n, "float32")
    fn = getattr(jax_gin, api)
    kw = {"tiled": True} if api in ("psum_scatter", "all_gather") else {}
    ours = smap(lambda v: fn(v, "i", axis_index_groups=None, **kw), mesh_1d(), P("i"))(x)
    ref = smap(lambda v: getattr(jax.lax, api)(v, "i", axis_index_groups=None, **kw),
               mesh_1d(), P("i"))(x)
    assert_bitwise(ours, ref)
    with pytest.raises(NotImplementedError, match=rf"jax_gin.{api}: axis_index_groups is not "
                                                  r"supported"):
        _trace(lambda v: fn(v, "i", axis_index_groups=[[0], [1]], **kw), x)


def test_lax_style_flags():
    # tiled=1 (lax takes any truthy value), None and NumPy booleans, as a program written for lax
    n = ndev()
    x = exact_input((n,), n, "float32")
    for tiled in (1, 0, None, np.bool_(True)):
        ours = smap(lambda v: jax_gin.all_gather(v, "i", tiled=tiled)[None], mesh_1d(), P("i"))(x)
        ref = smap(lambda v: jax.lax.all_gather(v, "i", tiled=tiled)[None], mesh_1d(), P("i"))(x)
        assert_bitwise(ours, ref)
    ours = smap(lambda v: jax_gin.psum(v, "i", overlap=np.bool_(False)), mesh_1d(), P("i"))(x)
    assert_bitwise(ours, smap(lambda v: jax.lax.psum(v, "i"), mesh_1d(), P("i"))(x))
    with pytest.raises(TypeError, match=r"tiled must be True or False, got 2"):
        _trace(lambda v: jax_gin.all_gather(v, "i", tiled=2), x)


@pytest.mark.parametrize("algo", ["ringg", "nccl", "", None, 3])
def test_unknown_algorithm(algo):
    x = exact_input((4,), ndev(), "float32")
    with pytest.raises(ValueError, match="unknown algorithm"):
        _trace(lambda v: jax_gin.psum(v, "i", algorithm=algo), x)


@pytest.mark.parametrize("axis", [0, np.int64(0), ("i", 0)])
def test_positional_axis_rejected(axis):
    x = exact_input((4,), ndev(), "float32")
    with pytest.raises(TypeError, match="positional"):
        _trace(lambda v: jax_gin.psum(v, axis), x)


@pytest.mark.parametrize("axis", [{"i"}, {"i": 1}, ("i", ["i"])])
def test_axis_name_of_no_name_is_named(axis):
    """A set or a dict as axis_name: a TypeError that names the argument."""
    x = exact_input((4,), ndev(), "float32")
    with pytest.raises(TypeError, match="jax_gin.psum: axis_name must be an axis name"):
        _trace(lambda v: jax_gin.psum(v, axis), x)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's workspace")
def test_workspace_past_the_address_space(monkeypatch):
    """A workspace per rank that is a valid setting (below 2**63) but whose windows, one per
    rank, exceed a size_t together: a ValueError naming the setting, before anything is
    mapped (a total that wrapped would map a few pages that the calls write past)."""
    needs_devices(2)
    monkeypatch.setattr(jax_gin.runtime.settings, "cpu_workspace_bytes", (1 << 63) - 1)
    x = exact_input((4,), ndev(), "float32")
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh_1d(), P("i"))
    with pytest.raises(ValueError, match=r"a workspace of 9223372036854775807 bytes per rank "
                       r"\(JAX_GIN_WORKSPACE_BYTES, settings.cpu_workspace_bytes\) over "
                       f"{ndev()} ranks exceeds the address space"):
        f(x)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU workspace's size")
def test_auto_picks_an_algorithm_whose_round_fits_the_workspace(monkeypatch):
    """A workspace that one round of auto's first choice does not fit, but another's does:
    auto runs that one (lax's bits), and explain says why; a named algorithm that does not
    fit still raises."""
    needs_devices(4)
    from jax_gin import _runtime
    n = ndev()
    monkeypatch.setattr(_runtime.settings, "cpu_workspace_bytes", 128)
    fits = [a for a in jax_gin.ALGORITHMS if _runtime.workspace_fits("cpu", a, n, 4)]
    assert fits and len(fits) < len(jax_gin.ALGORITHMS), fits
    # the model's choice above 64 KiB on CPU devices: two_shot, whose round does not fit
    spec = jax.ShapeDtypeStruct((16385,), jnp.float32)
    said = jax_gin.explain(spec, nranks=n, platform="cpu", device_kind="a device with no table")
    assert "two_shot" not in fits
    assert said.startswith(f"{fits[0]}: two_shot (") and \
        "does not fit one round in the workspace of 128 bytes per rank" in said, said
    x = exact_input((4097,), n, "float32")
    f = smap(lambda v: (jax_gin.psum(v, "i"), lax.psum(v, "i")), mesh_1d(), P("i"))
    assert_bitwise(*f(x))
    unfit = next(a for a in jax_gin.ALGORITHMS if a not in fits)
    with pytest.raises(ValueError, match=f"workspace too small: 128 bytes per rank cannot hold "
                                         f"one round of {unfit}"):
        smap(lambda v: jax_gin.psum(v, "i", algorithm=unfit), mesh_1d(), P("i")).lower(x)
    # psum_scatter and all_gather: where one_shot's round (a slot a rank) does not fit and
    # ring's (one fewer) does
    if n == 8:
        monkeypatch.setattr(_runtime.settings, "cpu_workspace_bytes", 112)
        assert not _runtime.workspace_fits("cpu", "one_shot", n, 4, True)
        assert _runtime.workspace_fits("cpu", "ring", n, 4, True)
        y = exact_input((8 * 40,), n, "float32")
        for api in ("psum_scatter", "all_gather"):
            said = jax_gin.explain(jax.ShapeDtypeStruct((8 * 40,), jnp.float32), nranks=n,
                                   platform="cpu", device_kind="none", collective=api)
            assert said.startswith("ring: one_shot ("), said
            g = smap(lambda v: (getattr(jax_gin, api)(v, "i", tiled=True),
                                getattr(lax, api)(v, "i", tiled=True)), mesh_1d(), P("i"))
            assert_bitwise(*g(y))


def test_workspace_too_small(monkeypatch):
    needs_devices(2)  # a group of one device needs no workspace
    # one_shot needs a 16-byte slot per rank: 16 bytes are too few for two ranks or more
    monkeypatch.setattr(jax_gin.runtime.settings, "cpu_workspace_bytes", 16)
    monkeypatch.setattr(jax_gin.runtime.settings, "gpu_workspace_bytes", 16)
    x = exact_input((4,), ndev(), "float32")
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm="one_shot"), mesh_1d(), P("i"))
    with pytest.raises(ValueError, match="jax_gin.psum: workspace too small"):
        f.lower(x)
    # the functions built on the all-reduce name themselves
    w = jnp.ones((4,), jnp.float32)
    f = smap(lambda v: jax_gin.psum_add_rmsnorm(v, v, w, "i", algorithm="one_shot")[0],
             mesh_1d(), P("i"))
    with pytest.raises(ValueError, match="jax_gin.psum_add_rmsnorm: workspace too small"):
        f.lower(x)
    f = smap(lambda v: jax_gin.psum_overlapping(v, "i", jnp.sin, v, algorithm="one_shot")[0],
             mesh_1d(), P("i"))
    with pytest.raises(ValueError, match="jax_gin.psum_overlapping: workspace too small"):
        f.lower(x)
    # auto, where none of its algorithms fits: named so, with the smallest round's need
    for api, g in (("psum", lambda v: jax_gin.psum(v, "i")),
                   ("psum_scatter", lambda v: jax_gin.psum_scatter(v, "i", tiled=True))):
        with pytest.raises(ValueError, match=rf"jax_gin.{api}: workspace too small: 16 bytes "
                                             r"per rank cannot hold one round of any algorithm "
                                             r"auto chooses among over \d+ ranks \(the smallest "
                                             r"round, \w+'s, needs at least \d+ bytes\)"):
            smap(g, mesh_1d(), P("i")).lower(exact_input((4 * ndev(),), ndev(), "float32"))


def test_eps_must_be_static():
    x = exact_input((4,), ndev(), "float32")
    w = jnp.ones((4,), jnp.float32)
    f = smap(lambda v: jax_gin.psum_add_rmsnorm(v, v, w, "i", eps=jnp.float32(1e-6))[0],
             mesh_1d(), P("i"))
    with pytest.raises(ValueError, match=r"psum_add_rmsnorm: eps must be a number >= 0 that is "
                                         r"finite in float32 \(a static Python or NumPy number, "
                                         r"not a JAX array\)"):
        f.lower(x)


def test_bad_env_setting(monkeypatch):
    monkeypatch.setenv("JAX_GIN_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="JAX_GIN_TIMEOUT_S"):
        jax_gin.runtime.Settings()


def test_cuda_lowering_without_cuda_build(monkeypatch):
    from jax_gin import _native
    monkeypatch.setattr(_native, "cuda", None)
    x = exact_input((4,), ndev(), "float32")
    # an explicit algorithm: over one device `auto` needs no kernel (test_group_of_one.py)
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm="one_shot"), mesh_1d(), P("i"))
    if _native.has_cuda() or _native.CUDA_IMPORT_ERROR is not None:
        monkeypatch.setattr(_native, "CUDA_IMPORT_ERROR", None)  # as in a build without CUDA
    with pytest.raises(NotImplementedError) as info:
        f.trace(x).lower(lowering_platforms=("cuda",))
    assert str(info.value) == (
        "jax_gin.psum: a CUDA lowering was requested, but jax_gin was built without CUDA support "
        "(it has no _jax_gin_cuda module); rebuild jax_gin with nvcc and the nvidia-nccl-cu13 "
        "wheel installed (JAX_GIN_CUDA=ON)")


def test_a_build_without_cuda_keeps_no_import_error():
    # where the module is absent, Python's ImportError ("... most likely due to a circular
    # import") says nothing true: it is not kept for the messages (_native.cuda_missing)
    from jax_gin import _native
    if _native.has_cuda():
        pytest.skip("the CUDA extension is loaded")
    import importlib.util
    if importlib.util.find_spec("jax_gin._jax_gin_cuda") is None:
        assert _native.CUDA_IMPORT_ERROR is None
        assert "circular" not in _native.cuda_missing()


_OTHER_PLATFORM_CALLS = {
    "psum": lambda v: jax_gin.psum(v, "i", algorithm="one_shot"),
    "pmax": lambda v: jax_gin.pmax(v, "i", algorithm="ring"),
    "psum_scatter": lambda v: jax_gin.psum_scatter(v, "i", tiled=True, algorithm="one_shot"),
    "all_gather": lambda v: jax_gin.all_gather(v, "i", tiled=True, algorithm="ring")[:v.shape[0]],
    "psum_overlapping": lambda v: jax_gin.psum_overlapping(v, "i", jnp.sin, v,
                                                           algorithm="one_shot")[0],
    "psum_add_rmsnorm": lambda v: jax_gin.psum_add_rmsnorm(
        v[None], v[None], jnp.ones_like(v), "i", algorithm="one_shot")[0][0],
}


@pytest.mark.parametrize("platforms,message", [
    (("cuda",), "this program is lowered for cuda, but its mesh's devices are cpu devices"),
    (("cpu", "cuda"), r"this program is lowered for several platforms at once \(cpu, cuda\)"),
])
@pytest.mark.parametrize("api", list(_OTHER_PLATFORM_CALLS))
def test_lowering_for_other_platforms_than_the_meshs(monkeypatch, api, platforms, message):
    # jax.export (or .lower(lowering_platforms=...)) of a program over CPU devices for GPUs, or
    # for several platforms: jax_gin sets up communicators on the mesh's devices as it lowers,
    # so it names the mismatch (instead of trying to make a CUDA communicator of CPU devices,
    # or JAX's TypeError from a conditional over per-platform rules)
    if jax.default_backend() != "cpu":
        pytest.skip("lowers CPU devices' programs for cuda")
    from jax_gin import _native
    monkeypatch.setattr(_native, "cuda", object())  # as where the CUDA extension was built
    x = exact_input((ndev() * 2,), ndev(), "float32")
    f = smap(_OTHER_PLATFORM_CALLS[api], mesh_1d(), P("i"))
    with pytest.raises(NotImplementedError, match=f"jax_gin.{api}: {message}"):
        f.trace(x).lower(lowering_platforms=platforms)
    f(x)  # and for its own platform it runs


def test_gpu_launch_settings_must_match_across_processes(monkeypatch):
    """The GPU bootstrap compares every process's launch settings: a different workspace,
    launch setting or default lane cap (SM count: different GPU models) is named, not run."""
    from jax_gin import _distributed
    from jax_gin._runtime import gpu_launch_settings, settings
    monkeypatch.setattr(settings, "max_lanes", None)
    mine = gpu_launch_settings(64 << 20, 128)
    _distributed.check_same_settings(mine, gpu_launch_settings(64 << 20, 128), 1, "group 0")
    with pytest.raises(ValueError, match=r"default max lanes.*128.*here but 108 in process 1"):
        _distributed.check_same_settings(mine, gpu_launch_settings(64 << 20, 108), 1, "group 0")
    with pytest.raises(ValueError, match=r"workspace_bytes=67108864 here but 33554432"):
        _distributed.check_same_settings(mine, gpu_launch_settings(32 << 20, 128), 1, "group 0")
    # max_lanes (JAX_GIN_MAX_LANES) set alike everywhere decides the lanes: the SM counts may
    # then differ
    monkeypatch.setattr(settings, "max_lanes", 64)
    _distributed.check_same_settings(gpu_launch_settings(64 << 20, 128),
                                     gpu_launch_settings(64 << 20, 108), 1, "group 0")
    # one_shot's chunk decides its flag tags: a difference is named too
    monkeypatch.setattr(settings, "one_shot_chunk_bytes", 16384)
    theirs = gpu_launch_settings(64 << 20, 128)
    monkeypatch.setattr(settings, "one_shot_chunk_bytes", 32768)
    with pytest.raises(ValueError, match=r"JAX_GIN_ONE_SHOT_CHUNK_BYTES=32768 here but 16384"):
        _distributed.check_same_settings(gpu_launch_settings(64 << 20, 128), theirs, 1, "group 0")


@pytest.mark.parametrize("var,value", [
    ("JAX_GIN_WORKSPACE_BYTES", "-5"), ("JAX_GIN_WORKSPACE_BYTES", "0"),
    ("JAX_GIN_WORKSPACE_BYTES", "0.5"), ("JAX_GIN_WORKSPACE_BYTES", "lots"),
    ("JAX_GIN_TIMEOUT_S", "0"), ("JAX_GIN_TIMEOUT_S", "-1"), ("JAX_GIN_TIMEOUT_S", "inf"),
    ("JAX_GIN_TIMEOUT_S", "nan"), ("JAX_GIN_BUCKET_BYTES", "0"), ("JAX_GIN_BUCKET_BYTES", "-1"),
    ("JAX_GIN_OVERLAP_LANES", "0"), ("JAX_GIN_OVERLAP_LANES", "129"),
    ("JAX_GIN_OVERLAP_LANES", "2.5"), ("JAX_GIN_MAX_LANES", "0"), ("JAX_GIN_MAX_LANES", "129"),
    ("JAX_GIN_LANE_GRAIN_BYTES", "0"), ("JAX_GIN_CHUNK_BYTES", "-1"),
    ("JAX_GIN_ONE_SHOT_CHUNK_BYTES", "1.5"), ("JAX_GIN_LL_MAX_BYTES", "big"),
    ("JAX_GIN_EXPERIMENTAL_GIN", "yes please"), ("JAX_GIN_EXPERIMENTAL_GIN", "2"),
    ("JAX_GIN_RECORD", "enabled"), ("JAX_GIN_SINGLE_PROCESS", "-1"),
])
def test_bad_env_values(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=rf"{var}='{re.escape(value)}': must be"):
        jax_gin.runtime.Settings()


def test_good_env_values(monkeypatch):
    monkeypatch.setenv("JAX_GIN_WORKSPACE_BYTES", "2e6")
    monkeypatch.setenv("JAX_GIN_TIMEOUT_S", "0.25")
    monkeypatch.setenv("JAX_GIN_BUCKET_BYTES", "")  # empty: the default
    monkeypatch.setenv("JAX_GIN_OVERLAP_LANES", "128")
    s = jax_gin.runtime.Settings()
    assert s.cpu_workspace_bytes == s.gpu_workspace_bytes == 2_000_000
    assert s.timeout_s == 0.25 and s.bucket_bytes == 64 << 20 and s.overlap_lanes == 128
    # the GPU launch settings: unset is None (the kernels' default); 0 turns chunks and LL off
    for var in ("JAX_GIN_MAX_LANES", "JAX_GIN_LANE_GRAIN_BYTES", "JAX_GIN_ONE_SHOT_CHUNK_BYTES",
                "JAX_GIN_EXPERIMENTAL_GIN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JAX_GIN_CHUNK_BYTES", "0")
    monkeypatch.setenv("JAX_GIN_LL_MAX_BYTES", "64e3")
    s = jax_gin.runtime.Settings()
    assert (s.max_lanes, s.lane_grain_bytes, s.one_shot_chunk_bytes) == (None, None, None)
    assert s.chunk_bytes == 0 and s.ll_max_bytes == 64_000 and s.experimental_gin is False
    monkeypatch.setenv("JAX_GIN_MAX_LANES", "128")
    monkeypatch.setenv("JAX_GIN_EXPERIMENTAL_GIN", "1")
    s = jax_gin.runtime.Settings()
    assert s.max_lanes == 128 and s.experimental_gin is True
    # boolean variables take JAX's words for its own flags, in any case
    for text, value in (("true", True), ("Yes", True), ("ON", True), ("false", False),
                        ("No", False), ("off", False), ("0", False), ("1", True)):
        for var in ("JAX_GIN_SINGLE_PROCESS", "JAX_GIN_RECORD", "JAX_GIN_EXPERIMENTAL_GIN"):
            monkeypatch.setenv(var, text)
        s = jax_gin.runtime.Settings()
        assert s.single_process is s.record is s.experimental_gin is value, text


def test_defaults_are_documented(monkeypatch):
    """The settings tables (README, docs/api.md), in an environment without JAX_GIN_ variables:
    the defaults there (the GPU launch settings are None here, the kernels' own defaults)."""
    import os
    for var in [v for v in os.environ if v.startswith("JAX_GIN_")]:
        monkeypatch.delenv(var)
    s = jax_gin.runtime.Settings()
    assert (s.bucket_bytes, s.cpu_workspace_bytes, s.gpu_workspace_bytes) == (64 << 20, 1 << 20, 64 << 20)
    assert s.timeout_s == 30 and (s.overlap_lanes, s.overlap_copy_engine_bytes) == (32, 32 << 20)
    assert (s.record, s.record_entries) == (False, 64)
    assert s.experimental_gin is False and s.single_process is False and s.tuning_dir is None
    assert (s.max_lanes, s.lane_grain_bytes, s.chunk_bytes, s.one_shot_chunk_bytes,
            s.ll_max_bytes) == (None,) * 5


def test_gpu_launch_defaults_are_documented():
    """docs/api.md's GPU launch settings: those left None take the kernels' defaults
    (LaunchConfig), and max_lanes at most the GPU's SM count."""
    if not jax_gin.has_cuda():
        pytest.skip("needs the CUDA extension")
    cuda = jax_gin._native.cuda
    assert cuda.default_launch() == {"max_lanes": 128, "lane_grain_bytes": 16 << 10,
                                     "chunk_bytes": 512 << 10, "one_shot_chunk_bytes": 32 << 10,
                                     "ll_max_bytes": 256 << 10}
    for d in (jax.devices() if jax.default_backend() == "gpu" else []):
        assert cuda.default_max_lanes(d.local_hardware_id) == min(128, d.core_count)


@pytest.mark.parametrize("field,value,var", [
    ("cpu_workspace_bytes", -5, "JAX_GIN_WORKSPACE_BYTES"),
    ("gpu_workspace_bytes", 1.5, "JAX_GIN_WORKSPACE_BYTES"),
    ("timeout_s", 0, "JAX_GIN_TIMEOUT_S"), ("timeout_s", -1.0, "JAX_GIN_TIMEOUT_S"),
    ("timeout_s", "3", "JAX_GIN_TIMEOUT_S"), ("bucket_bytes", 0, "JAX_GIN_BUCKET_BYTES"),
    ("overlap_lanes", 200, "JAX_GIN_OVERLAP_LANES"), ("overlap_lanes", True, "JAX_GIN_OVERLAP_LANES"),
    ("max_lanes", 0, "JAX_GIN_MAX_LANES"), ("chunk_bytes", -1, "JAX_GIN_CHUNK_BYTES"),
    ("experimental_gin", "1", "JAX_GIN_EXPERIMENTAL_GIN"),
    ("cpu_workspace_bytes", 2**70, "JAX_GIN_WORKSPACE_BYTES"),
    ("chunk_bytes", 2**63, "JAX_GIN_CHUNK_BYTES"),
])
def test_bad_settings_assignment(field, value, var):
    settings = jax_gin.runtime.settings
    before = getattr(settings, field)
    with pytest.raises(ValueError, match=rf"settings\.{field} = {re.escape(repr(value))} \({var}\): must be"):
        setattr(settings, field, value)
    assert getattr(settings, field) == before


def test_unknown_setting_and_bad_fault_rank():
    settings = jax_gin.runtime.settings
    with pytest.raises(AttributeError, match=r"has no setting 'workspace_bytes' "
                                             r"\(JAX_GIN_WORKSPACE_BYTES sets cpu_workspace_bytes "
                                             r"and gpu_workspace_bytes\); the settings are "
                                             r"cpu_workspace_bytes, gpu_workspace_bytes, "):
        settings.workspace_bytes = 4096
    with pytest.raises(AttributeError, match=r"has no setting 'bucket_byte'; the settings are"):
        settings.bucket_byte = 1
    assert not hasattr(settings, "workspace_bytes") and not hasattr(settings, "bucket_byte")
    for bad in ("abc", 1.5, None, -2, True):
        with pytest.raises(ValueError, match=r"settings.fault_rank = .*: must be a rank, or -1"):
            settings.fault_rank = bad
    assert settings.fault_rank == -1


def test_bad_env_value_fails_at_import():
    import os
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_GIN_WORKSPACE_BYTES="-5")
    proc = subprocess.run([sys.executable, "-c", "import jax_gin"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "ValueError: jax_gin: JAX_GIN_WORKSPACE_BYTES='-5': must be a positive integer" \
        in proc.stderr, proc.stderr


@pytest.mark.parametrize("nranks", [0, -1, 129, 1000, 2.0, True, "8"])
def test_explain_bad_nranks(nranks):
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    with pytest.raises(ValueError, match=rf"nranks={re.escape(repr(nranks))}: expected an integer from 1 to 128"):
        jax_gin.explain(x, nranks=nranks, platform="cpu")


@pytest.mark.parametrize("platform", ["tpu", "CUDA", "rocm", ""])
def test_explain_bad_platform(platform):
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    with pytest.raises(ValueError, match=rf"unknown platform {re.escape(repr(platform))}; "
                                         r"expected one of 'cpu', 'cuda', 'gpu'"):
        jax_gin.explain(x, nranks=8, platform=platform)


def test_explain_accepts_its_range():
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    assert jax_gin.explain(x, nranks=1, platform="cpu") == \
        "no call: a group of one rank, whose result is its input (platform cpu, 1 rank, 4096 " \
        "bytes per device)"
    assert "128 ranks" in jax_gin.explain(x, nranks=128, platform="cuda")
    # 'gpu' is what jax.default_backend() and Device.platform say on CUDA devices
    assert jax_gin.explain(x, nranks=8, platform="gpu") == \
        jax_gin.explain(x, nranks=8, platform="cuda").replace("platform cuda", "platform gpu")


def test_explain_of_this_platform_named_reads_its_table():
    # naming the platform this machine runs on keeps its device kind (and so its table)
    x = jax.ShapeDtypeStruct((50_000,), jnp.float32)
    n = len(jax.devices())
    assert jax_gin.explain(x, nranks=n, platform=jax.default_backend()) == \
        jax_gin.explain(x, nranks=n)


def test_explain_names_itself_for_a_dtype_the_collective_refuses():
    x = jax.ShapeDtypeStruct((10,), jnp.int8)
    with pytest.raises(TypeError, match=r"^jax_gin.explain: jax_gin.psum: unsupported dtype int8"):
        jax_gin.explain(x, nranks=8)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "PSUM", None])
def test_explain_bad_collective(collective):
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    with pytest.raises(ValueError, match=rf"unknown collective {re.escape(repr(collective))}; "
                                         r"expected one of 'psum', 'pmax', 'pmin', "
                                         r"'psum_scatter', 'all_gather'"):
        jax_gin.explain(x, nranks=8, platform="cpu", collective=collective)


def test_explain_psum_scatter_needs_n_blocks():
    x = jax.ShapeDtypeStruct((1001,), jnp.float32)
    with pytest.raises(ValueError, match=r"psum_scatter of 1001 elements over 8 ranks: its input "
                                         r"holds N equal blocks, so a multiple of 8"):
        jax_gin.explain(x, nranks=8, platform="cpu", collective="psum_scatter")


def test_explain_bad_values():
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    with pytest.raises(TypeError, match=r"jax_gin.explain: device_kind must be a string"):
        jax_gin.explain(x, nranks=8, platform="cuda", device_kind=123)
    # a dtype the collective rejects, with the collective's own error
    with pytest.raises(TypeError, match=r"jax_gin.psum: unsupported dtype int8"):
        jax_gin.explain(jax.ShapeDtypeStruct((8,), jnp.int8), nranks=8)
    with pytest.raises(TypeError, match=r"jax_gin.pmax: complex values have no order"):
        jax_gin.explain(jax.ShapeDtypeStruct((8,), jnp.complex64), nranks=8, collective="pmax")
    with pytest.raises(TypeError, match=r"jax_gin.psum_scatter: unsupported dtype bool"):
        jax_gin.explain(jax.ShapeDtypeStruct((8,), jnp.bool_), nranks=8, collective="psum_scatter")
    with pytest.raises(TypeError, match=r"^jax_gin.explain: 'abc' is not an array, a "
                                        r"ShapeDtypeStruct or a scalar"):
        jax_gin.explain("abc", nranks=8)  # named once
    with pytest.raises(TypeError, match=r"is not an array, a ShapeDtypeStruct or a scalar"):
        jax_gin.explain(object(), nranks=8)


@pytest.mark.parametrize("collective", ["psum", "pmax", "psum_scatter", "all_gather"])
def test_explain_of_no_elements(collective):
    """An empty buffer launches nothing (the lowering makes no call), which explain says."""
    x = jax.ShapeDtypeStruct((0, 4), jnp.float32)
    assert jax_gin.explain(x, nranks=8, platform="cpu", collective=collective).startswith(
        "no call: 0 bytes per device")
    with pytest.raises(ValueError, match=r"the value has no leaves"):
        jax_gin.explain({}, nranks=8)
    with pytest.raises(ValueError, match=r"bucket_bytes must be a positive integer"):
        jax_gin.explain(x, nranks=8, bucket_bytes=0)
    with pytest.raises(NameError, match=r"unbound axis name: i.*pass nranks alone"):
        jax_gin.explain(x, "i", nranks=8)  # outside shard_map
    seen = []

    def body(v):
        with pytest.raises(ValueError, match=rf"nranks={ndev() + 1} disagrees with axis 'i', "
                                             rf"which has {ndev()} devices"):
            jax_gin.explain(v, "i", nranks=ndev() + 1)
        seen.append(True)
        return v

    smap(body, mesh_1d(), P("i"))(jnp.zeros((ndev(),), jnp.float32))
    assert seen


_SYMBOLIC_CALLS = {
    "psum": lambda v: jax_gin.psum({"a": v}, "i"),
    "pmax": lambda v: jax_gin.pmax(v, "i"),
    "psum_scatter": lambda v: jax_gin.psum_scatter(v, "i", tiled=True),
    "all_gather": lambda v: jax_gin.all_gather(v, "i", tiled=True),
    "psum_add_rmsnorm": lambda v: jax_gin.psum_add_rmsnorm(v, v, jnp.ones(4, v.dtype), "i")[0],
}


@pytest.mark.parametrize("api", list(_SYMBOLIC_CALLS))
def test_symbolic_shapes_are_refused(api):
    """jax.export's shape polymorphism: a call is sized at lowering, so a symbolic dimension
    gets jax_gin's error, not one from inside its bucketing (lax.psum exports such shapes)."""
    from jax import export
    n = ndev()
    spec = jax.ShapeDtypeStruct(export.symbolic_shape(f"{n}*b, 4"), jnp.float32,
                                sharding=jax.NamedSharding(mesh_1d(), P("i")))
    with pytest.raises(ValueError, match=rf"jax_gin\.{api}: shape \(b, 4\) has a symbolic "
                                         r"dimension; .* concrete shapes only"):
        export.export(smap(_SYMBOLIC_CALLS[api], mesh_1d(), P("i"), check_vma=False))(spec)
    with pytest.raises(ValueError, match=r"jax_gin\.explain: shape \(b, 4\) has a symbolic"):
        jax_gin.explain(jax.ShapeDtypeStruct(export.symbolic_shape("b, 4"), jnp.float32),
                        nranks=8, collective="psum" if api.startswith("psum_add") else api)


def test_nested_shard_map_needs_the_concrete_mesh():
    # An inner shard_map given no Mesh lowers over the context's abstract mesh: jax_gin names
    # the fix, and under jax.set_mesh the nested call equals lax's.
    from conftest import mesh_2d
    from jax import lax
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    x = exact_input((nx * 2, 3 * ny), 1, "float32").reshape(nx * 2, 3 * ny)

    def run(psum):
        def outer(v):
            return jax.shard_map(lambda u: psum(u, "y"), in_specs=P(None, "y"),
                                 out_specs=P(None, None), axis_names={"y"})(v)
        return jax.jit(jax.shard_map(outer, mesh=mesh, in_specs=P("x", None),
                                     out_specs=P("x", None), axis_names={"x"}))(x)

    with pytest.raises(ValueError, match=r"abstract mesh.*jax\.set_mesh"):
        run(jax_gin.psum)
    with jax.set_mesh(mesh):
        got = run(jax_gin.psum)
    assert_bitwise(got, run(lax.psum))


def test_jax_version_guard(monkeypatch):
    # a jax outside the range of jax_gin's package metadata warns at import, naming both
    from jax_gin import _compat
    assert _compat._jax_in_range("0.11.2", ">=0.11.2,<0.13")
    assert _compat._jax_in_range("0.12.0.1", ">=0.11.2,<0.13")
    assert not _compat._jax_in_range("0.11.1", ">=0.11.2,<0.13")
    assert not _compat._jax_in_range("0.13.0", ">=0.11.2,<0.13")
    monkeypatch.setattr(_compat, "_supported_jax", lambda: ">=0.11.2,<0.13")
    monkeypatch.setattr(jax, "__version__", "0.13.1")
    with pytest.warns(RuntimeWarning, match=r"jax_gin supports jax>=0.11.2,<0.13, but jax 0.13.1 "
                                         r"is installed"):
        _compat._check_jax_version()
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat._check_jax_version()


def test_communicator_reset_while_lowering():
    # reset() on another thread between a lowering's communicator() and its custom call's
    # attribute: a RuntimeError that says so (it was a KeyError)
    from jax_gin import _runtime
    with pytest.raises(RuntimeError, match=r"communicator 987654 was destroyed by "
                                           r"jax_gin.runtime.reset\(\) while a program"):
        _runtime.comm_attribute("cpu", 987654)


@pytest.mark.parametrize("field", ["single_process", "record", "experimental_gin"])
def test_boolean_settings_take_the_same_values(field):
    # Every boolean setting takes bool, numpy's bool and the integers 0 and 1, and refuses
    # other values alike (single_process took only a Python bool)
    settings = jax_gin.runtime.Settings()
    for value, want in ((True, True), (np.bool_(False), False), (1, True), (0, False)):
        setattr(settings, field, value)
        assert getattr(settings, field) is want, value
    for bad in (2, "1", 0.0):
        with pytest.raises(ValueError, match=rf"settings\.{field} = {re.escape(repr(bad))}"):
            setattr(settings, field, bad)


@pytest.mark.parametrize("change,error,message", [
    ({"dtype": jnp.int8}, TypeError, "operand 0 has dtype int8; the primitive takes float32"),
    ({"second": jnp.int32}, TypeError, "the operands of one call share a dtype; operand 0 has "
                                       "float32, operand 1 int32"),
    ({"op": "prod"}, ValueError, "unknown op 'prod'; expected one of 'sum', 'max', 'min'"),
    ({"algorithm": "bogus"}, ValueError, "unknown algorithm 'bogus'; expected 'auto' or one of"),
])
def test_allreduce_p_bound_wrongly_fails_at_trace_time(change, error, message):
    """jax_gin.allreduce_p, public for rules of one's own, checks at trace time what jax_gin's
    functions bind by construction: dtypes, one dtype per call, op and algorithm."""
    params = dict(axes=("i",), op=change.get("op", "sum"),
                  algorithm=change.get("algorithm", "one_shot"), invariant=False, overlap=False)

    def body(v):
        ops = [v.astype(change.get("dtype", jnp.float32))]
        if "second" in change:
            ops.append(v.astype(change["second"]))
        return jax_gin.allreduce_p.bind(*ops, **params)[0].astype(jnp.float32)
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("i"), out_specs=P("i"),
                              check_vma=False))
    with pytest.raises(error, match="jax_gin.allreduce_p: " + re.escape(message)):
        f.trace(jnp.arange(ndev() * 4.0))
