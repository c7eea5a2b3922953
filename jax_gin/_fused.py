"""psum_add_rmsnorm: an all-reduce sum fused with a residual add and an RMSNorm.

One primitive, `jax_gin_psum_add_rmsnorm`, with operands (x, residual, weight) and results
(normed, new_residual), and params:
  axes       tuple of mesh axis names x is summed over
  algorithm  "auto" or a name in ALGORITHMS (resolved at lowering, as for psum)
  eps        the norm's epsilon (a Python float; float32 in the computation)
  invariant  True when traced under shard_map(check_vma=True): x must vary over `axes`, and
             the results vary over what residual + psum(x) (and its product with weight)
             varies over; the wrapper marks residual and weight as varying over those axes
             beforehand, so that all three rules see one typing.

It lowers to one custom call that all-reduces x into new_residual and then applies the
epilogue (include/jax_gin/norm.h). Where `auto` chooses XLA's own all-reduce, or in a
partially-manual shard_map, it lowers to the unfused composition instead. Its JVP is the
unfused composition's (jax_gin's psum of the tangent, then the norm's JVP), so gradients
match it; the transposes are those of psum and of jnp's operations.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from . import _compat, _select
from ._primitive import (TOKEN, _chain_token, _normalize_axes, _set_chain_token, allreduce_p,
                         check_no_open_start, order_aval, resolve_call)

API = "psum_add_rmsnorm"
# The element types of the epilogue: those that accumulate in float32 (norm.h).
NORM_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))

psum_add_rmsnorm_p = Primitive("jax_gin_psum_add_rmsnorm")
psum_add_rmsnorm_p.multiple_results = True

CPU_TARGET = "jax_gin_add_rmsnorm_cpu"
CUDA_TARGET = "jax_gin_add_rmsnorm_cuda"


def psum_add_rmsnorm(x, residual, weight, axis_name, *, eps: float = 1e-6,
                     algorithm: str = "auto"):
    """``(normed, new_residual)``: ``new_residual = residual + psum(x, axis_name)`` and
    ``normed = (r * rsqrt(mean(r**2, -1) + eps)).astype(x.dtype) * weight`` with ``r`` the new
    residual in float32, in one collective call inside ``jax.shard_map``.

    x and residual have one shape ``(..., d)`` and dtype (float32, bfloat16 or float16);
    weight is ``(d,)`` of that dtype. The sum is jax_gin's psum with `algorithm` (bit for bit
    the same as ``jax_gin.psum``), the add rounds once to the dtype, and the norm is computed
    per row in float32, identically on every device of the group. Differentiable: gradients
    are those of the unfused composition.
    """
    algorithm = _select.validate(algorithm, API)
    eps = _check_eps(eps)
    x, residual, weight = (v if hasattr(v, "dtype") else jnp.asarray(v) for v in (x, residual, weight))
    _check_operands(x, residual, weight)
    axes = _normalize_axes(axis_name, API)
    if not axes or not _compat.is_tracer(x):
        # Nothing to reduce, or a constant x (the same everywhere: psum scales it).
        from ._primitive import psum
        new_res = residual + (psum(x, axes, algorithm=algorithm) if axes else x)
        return _norm(new_res, weight, eps), new_res
    invariant = _compat.check_vma_enabled()
    if invariant:
        if set(axes) <= _compat.unreduced_axes(jax.typeof(x)):
            raise NotImplementedError(
                f"jax_gin.{API} of an unreduced x is not supported; use jax_gin.psum and the norm")
        manual = _compat.manual_mesh_axes()
        vx = _compat.varying_axes(jax.typeof(x))
        x = _compat.pcast_varying(x, tuple(a for a in axes if a in manual and a not in vx))
        rv, nv = _result_vma(x, residual, weight, axes)
        residual = _vary_to(residual, rv)
        weight = _vary_to(weight, nv)
    return tuple(psum_add_rmsnorm_p.bind(x, residual, weight, axes=axes, algorithm=algorithm,
                                         eps=eps, invariant=invariant))


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(eps)) or float(eps) < 0:
        raise ValueError(f"jax_gin.{API}: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _check_operands(x, residual, weight):
    dt = np.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"jax_gin.{API}: x must be a floating-point array, got dtype {dt}")
    if dt not in NORM_DTYPES:
        raise TypeError(f"jax_gin.{API}: unsupported dtype {dt}; supported dtypes are "
                        f"{', '.join(str(d) for d in NORM_DTYPES)}")
    if np.ndim(x) < 1:
        raise ValueError(f"jax_gin.{API}: x must have at least one dimension (rows of d), "
                         f"got shape {np.shape(x)}")
    if np.shape(residual) != np.shape(x) or np.dtype(residual.dtype) != dt:
        raise ValueError(f"jax_gin.{API}: residual must have x's shape and dtype {np.shape(x)} "
                         f"{dt}, got {np.shape(residual)} {np.dtype(residual.dtype)}")
    d = np.shape(x)[-1]
    if np.shape(weight) != (d,) or np.dtype(weight.dtype) != dt:
        raise ValueError(f"jax_gin.{API}: weight must be 1-D of size x.shape[-1] = {d} and dtype "
                         f"{dt}, got {np.shape(weight)} {np.dtype(weight.dtype)}")


def _result_vma(x, residual, weight, axes):
    """The axes new_residual and normed vary over (check_vma=True)."""
    rv = (_compat.varying_axes(jax.typeof(x)) - frozenset(axes)) | _compat.varying_axes(jax.typeof(residual))
    return rv, rv | _compat.varying_axes(jax.typeof(weight))


def _vary_to(v, vma: frozenset):
    """v marked as varying over `vma` (a superset of what it varies over)."""
    missing = tuple(sorted(vma - _compat.varying_axes(jax.typeof(v)), key=str))
    return _compat.pcast_varying(v, missing)


def _norm(new_res, weight, eps):
    """The epilogue in jnp: what the native code computes (norm.h)."""
    r = new_res.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
    return (r * inv).astype(new_res.dtype) * weight


def _unfused(x, residual, weight, *, axes, algorithm, eps, invariant):
    """The same results without the fused call: jax_gin's psum, then the epilogue in XLA."""
    (s,) = allreduce_p.bind(x, axes=axes, op="sum", algorithm=algorithm, invariant=invariant,
                            overlap=False)
    if invariant:
        s = _vary_to(s, _compat.varying_axes(jax.typeof(residual)))
    new_res = residual + s
    return [_norm(new_res, weight, eps), new_res]


# ---------------------------------------------------------------------------------------
# Rules


def _abstract_eval(x, residual, weight, *, axes, algorithm, eps, invariant):
    for a in axes:
        if not _compat.axis_exists(a):
            raise NameError(f"jax_gin.{API}: unknown axis name {a!r}")
    _check_operands(x, residual, weight)
    if not invariant:
        return [x.update(weak_type=False), residual.update(weak_type=False)], \
            {_compat.NamedAxisEffect(a) for a in axes}
    vx = _compat.varying_axes(x)
    mesh_axes = set(axes) & _compat.manual_mesh_axes()
    if not mesh_axes <= vx:
        raise ValueError(f"jax_gin.{API}: with check_vma=True x must vary over the reduced axes "
                         f"{axes}; it varies over {sorted(vx)}")
    rv = (vx - frozenset(axes)) | _compat.varying_axes(residual)
    nv = rv | _compat.varying_axes(weight)
    return [_compat.with_varying_axes(x.update(weak_type=False), nv),
            _compat.with_varying_axes(residual.update(weak_type=False), rv)], \
        {_compat.NamedAxisEffect(a) for a in axes}


def _jvp(primals, tangents, *, axes, algorithm, eps, invariant):
    x, residual, weight = primals
    tx, tres, tw = tangents
    normed, new_res = psum_add_rmsnorm_p.bind(x, residual, weight, axes=axes, algorithm=algorithm,
                                              eps=eps, invariant=invariant)
    rv = _compat.varying_axes(jax.typeof(new_res)) if invariant else frozenset()
    t_r = None
    if type(tx) is not ad.Zero:
        (t_r,) = allreduce_p.bind(tx, axes=axes, op="sum", algorithm=algorithm,
                                  invariant=invariant, overlap=False)
        if invariant:
            t_r = _vary_to(t_r, rv)
    if type(tres) is not ad.Zero:
        t_r = tres if t_r is None else t_r + tres
    if t_r is None:
        t_r = ad.instantiate_zeros(tres)
    tw = ad.instantiate_zeros(tw)
    _, t_normed = jax.jvp(functools.partial(_norm, eps=eps), (new_res, weight), (t_r, tw))
    return [normed, new_res], [t_normed, t_r]


def _batch(axis_data, vals_in, dims_in, *, axes, algorithm, eps, invariant):
    params = dict(axes=axes, algorithm=algorithm, eps=eps, invariant=invariant)
    if axis_data.name in axes:
        raise NotImplementedError(
            f"jax_gin.{API} over a vmapped axis is not supported; use jax_gin.psum and the norm")
    x, residual, weight = vals_in
    dx, dres, dw = dims_in
    size = axis_data.size
    x = jnp.broadcast_to(x, (size,) + x.shape) if dx is None else jnp.moveaxis(x, dx, 0)
    residual = (jnp.broadcast_to(residual, (size,) + residual.shape) if dres is None
                else jnp.moveaxis(residual, dres, 0))
    if dw is None:
        # every row of every batch element takes the same weight: the fused call as it is
        return psum_add_rmsnorm_p.bind(x, residual, weight, **params), [0, 0]
    # A weight per batch element: the fused call with a weight of ones, then the product with
    # each row's weight, which rounds as the native product does (norm.h: T(T(r * inv) * w)).
    ones = jnp.ones((x.shape[-1],), x.dtype)
    if invariant:
        ones = _vary_to(ones, _compat.varying_axes(jax.typeof(weight)))
    normed, new_res = psum_add_rmsnorm_p.bind(x, residual, ones, **params)
    weight = jnp.moveaxis(weight, dw, 0).reshape((size,) + (1,) * (x.ndim - 2) + (x.shape[-1],))
    return [normed * weight, new_res], [0, 0]


def _lowering(ctx, x, residual, weight, *, axes, algorithm, eps, invariant, platform):
    call = resolve_call(ctx, ctx.avals_in[:1], axes, "sum", algorithm, platform)
    if call is None or call.partial:
        # `auto` chose XLA's all-reduce, or a partially-manual shard_map: the unfused composition
        return mlir.lower_fun(functools.partial(_unfused, axes=axes, algorithm=algorithm, eps=eps,
                                                invariant=invariant),
                              multiple_results=True)(ctx, x, residual, weight)
    check_no_open_start(ctx, API)
    target = CPU_TARGET if platform == "cpu" else CUDA_TARGET
    order = order_aval(platform)
    with call.named(API, platform, 1, False):
        tok, normed, new_res = jax.ffi.ffi_lowering(target)(
            ctx.replace(avals_in=[TOKEN, order, *ctx.avals_in], avals_out=[order, *ctx.avals_out]),
            _compat.partition_id(), _chain_token(ctx, platform), x, residual, weight,
            comm=call.attrs["comm"], algorithm=call.attrs["algorithm"], eps=np.float32(eps))
    _set_chain_token(ctx, tok, platform)
    return [normed, new_res]


def _impl(*args, axes, **params):
    raise NameError(f"jax_gin.{API} must be called inside jax.shard_map (axes {axes} are not bound here)")


psum_add_rmsnorm_p.def_impl(_impl)
psum_add_rmsnorm_p.def_effectful_abstract_eval(_abstract_eval)
ad.primitive_jvps[psum_add_rmsnorm_p] = _jvp
_compat.batching.fancy_primitive_batchers[psum_add_rmsnorm_p] = _batch
# Not cacheable, for the order token chain (as allreduce_p).
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(
        psum_add_rmsnorm_p,
        lambda ctx, *a, _p=_platform, **kw: _lowering(ctx, *a, platform=_p, **kw),
        platform=_platform, cacheable=False)
