"""psum_add_rmsnorm and psum_add_layernorm: an all-reduce sum fused with a residual add and
an RMSNorm or a LayerNorm.

Two primitives, `jax_gin_psum_add_rmsnorm` with operands (x, residual, weight) and
`jax_gin_psum_add_layernorm` with operands (x, residual, weight, bias), each with results
(normed, new_residual), and params:
  axes       tuple of mesh axis names x is summed over
  algorithm  "auto" or a name in ALGORITHMS (resolved at lowering, as for psum)
  eps        the norm's epsilon (a Python float; float32 in the computation)
  invariant  True when traced under shard_map(check_vma=True): x must vary over `axes`, and
             the results vary over what residual + psum(x) (and its product with weight and
             bias) varies over; the wrapper marks residual, weight and bias as varying over
             those axes beforehand, so that all three rules see one typing.

Each lowers to one custom call that all-reduces x into new_residual and then applies the
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
from ._ops import refuse_symbolic
from ._primitive import (TOKEN, _chain_token, _normalize_axes, _set_chain_token, allreduce_p,
                         check_no_open_start, order_aval, register_lowering, resolve_call,
                         vary_over)

# The element types of the epilogues: those that accumulate in float32 (norm.h).
NORM_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


class _Kind:
    """One fused norm: its API name, primitive, custom-call targets and its operands after
    residual (the weight, and LayerNorm's bias)."""

    def __init__(self, api, params):
        self.api = api
        self.params = params
        self.prim = Primitive(f"jax_gin_{api}")
        self.prim.multiple_results = True
        short = api.replace("psum_", "")
        self.cpu_target, self.cuda_target = f"jax_gin_{short}_cpu", f"jax_gin_{short}_cuda"


RMS = _Kind("psum_add_rmsnorm", ("weight",))
LAYER = _Kind("psum_add_layernorm", ("weight", "bias"))
KINDS = (RMS, LAYER)
psum_add_rmsnorm_p, psum_add_layernorm_p = RMS.prim, LAYER.prim


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
    return _fused(RMS, x, residual, (weight,), axis_name, eps, algorithm)


def psum_add_layernorm(x, residual, weight, bias, axis_name, *, eps: float = 1e-5,
                       algorithm: str = "auto"):
    """``(normed, new_residual)``: ``new_residual = residual + psum(x, axis_name)`` and
    ``normed = ((r - m) * rsqrt(mean((r - m)**2, -1) + eps)).astype(x.dtype) * weight + bias``
    with ``r`` the new residual in float32 and ``m = mean(r, -1)``, in one collective call
    inside ``jax.shard_map``.

    As psum_add_rmsnorm, with a bias ``(d,)`` of x's dtype; the product with the weight and
    the sum with the bias each round to the dtype, as jnp's operations in that dtype do.
    """
    return _fused(LAYER, x, residual, (weight, bias), axis_name, eps, algorithm)


def _fused(kind, x, residual, params, axis_name, eps, algorithm):
    api = kind.api
    algorithm = _select.validate(algorithm, api)
    eps = _check_eps(eps, api)
    names = ("x", "residual") + (("weight",) if kind is RMS else ("weight", "bias"))
    for name, v in zip(names, (x, residual, *params)):
        if v is None:  # (jnp.asarray(None) names no argument)
            raise TypeError(f"jax_gin.{api}: {name} is None; pass an array (a weight of ones "
                            "and a bias of zeros leave the norm as it is)")
    x, residual, *params = (v if hasattr(v, "dtype") else jnp.asarray(v)
                            for v in (x, residual, *params))
    _check_operands(kind, x, residual, params)
    axes = _normalize_axes(axis_name, api)
    if not axes or not _compat.is_tracer(x):
        # Nothing to reduce, or a constant x (the same everywhere: psum scales it).
        from ._primitive import psum
        new_res = residual + (psum(x, axes, algorithm=algorithm) if axes else x)
        return _norm(new_res, *params, eps=eps), new_res
    invariant = _compat.check_vma_enabled()
    if invariant:
        if set(axes) <= _compat.unreduced_axes(jax.typeof(x)):
            raise NotImplementedError(
                f"jax_gin.{api} of an unreduced x is not supported; use jax_gin.psum and the norm")
        x = vary_over(x, axes, api)
        rv, nv = _result_vma(x, residual, params, axes)
        residual = _vary_to(residual, rv)
        params = [_vary_to(p, nv) for p in params]
    return tuple(kind.prim.bind(x, residual, *params, axes=axes, algorithm=algorithm, eps=eps,
                                invariant=invariant))


def _check_eps(eps, api) -> float:
    # finite in float32 too: the norm adds it in float32, where 1e40 would be inf
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(eps)) or float(eps) < 0 \
            or float(eps) > float(np.finfo(np.float32).max):
        raise ValueError(f"jax_gin.{api}: eps must be a number >= 0 that is finite in float32 "
                         f"(a static Python or NumPy number, not a JAX array), got {eps!r}")
    return float(eps)


def _check_operands(kind, x, residual, params):
    api = kind.api
    refuse_symbolic(np.shape(x), api)
    dt = np.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"jax_gin.{api}: x must be a floating-point array, got dtype {dt}")
    if dt not in NORM_DTYPES:
        raise TypeError(f"jax_gin.{api}: unsupported dtype {dt}; supported dtypes are "
                        f"{', '.join(str(d) for d in NORM_DTYPES)}")
    if np.ndim(x) < 1:
        raise ValueError(f"jax_gin.{api}: x must have at least one dimension (rows of d), "
                         f"got shape {np.shape(x)}")
    if np.shape(residual) != np.shape(x):
        raise ValueError(f"jax_gin.{api}: residual must have x's shape {np.shape(x)}, got "
                         f"{np.shape(residual)}")
    d = np.shape(x)[-1]
    for name, v in zip(kind.params, params):
        if np.shape(v) != (d,):
            raise ValueError(f"jax_gin.{api}: {name} must be 1-D of size x.shape[-1] = {d}, "
                             f"got shape {np.shape(v)}")
    # one dtype: the call has no promotion (jnp's composition would promote to the wider one)
    for name, v in (("residual", residual),) + tuple(zip(kind.params, params)):
        if np.dtype(v.dtype) != dt:
            raise TypeError(f"jax_gin.{api}: {name} must have x's dtype {dt}, got "
                            f"{np.dtype(v.dtype)} (the call takes one dtype: cast it)")


def _result_vma(x, residual, params, axes):
    """The axes new_residual and normed vary over (check_vma=True)."""
    rv = (_compat.varying_axes(jax.typeof(x)) - frozenset(axes)) | _compat.varying_axes(jax.typeof(residual))
    nv = rv
    for p in params:
        nv = nv | _compat.varying_axes(jax.typeof(p))
    return rv, nv


def _vary_to(v, vma: frozenset):
    """v marked as varying over `vma` (a superset of what it varies over)."""
    missing = tuple(sorted(vma - _compat.varying_axes(jax.typeof(v)), key=str))
    return _compat.pcast_varying(v, missing)


def _norm(new_res, weight, bias=None, *, eps):
    """The epilogue in jnp: what the native code computes (norm.h); LayerNorm with a bias."""
    r = new_res.astype(jnp.float32)
    if bias is not None:
        r = r - jnp.mean(r, axis=-1, keepdims=True)
    inv = lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
    out = (r * inv).astype(new_res.dtype) * weight
    return out if bias is None else out + bias


def _unfused(x, residual, *params, axes, algorithm, eps, invariant):
    """The same results without the fused call: jax_gin's psum, then the epilogue in XLA."""
    (s,) = allreduce_p.bind(x, axes=axes, op="sum", algorithm=algorithm, invariant=invariant,
                            overlap=False)
    if invariant:
        s = _vary_to(s, _compat.varying_axes(jax.typeof(residual)))
    new_res = residual + s
    return [_norm(new_res, *params, eps=eps), new_res]


# ---------------------------------------------------------------------------------------
# Rules (of both primitives: `kind` tells them apart)


def _abstract_eval(kind, x, residual, *params, axes, algorithm, eps, invariant):
    for a in axes:
        if not _compat.axis_exists(a):
            raise NameError(f"jax_gin.{kind.api}: unknown axis name {a!r}")
    _check_operands(kind, x, residual, params)
    if not invariant:
        return [x.update(weak_type=False), residual.update(weak_type=False)], \
            {_compat.NamedAxisEffect(a) for a in axes}
    vx = _compat.varying_axes(x)
    mesh_axes = set(axes) & _compat.manual_mesh_axes()
    if not mesh_axes <= vx:
        raise ValueError(f"jax_gin.{kind.api}: with check_vma=True x must vary over the reduced "
                         f"axes {axes}; it varies over {sorted(vx)}")
    rv = (vx - frozenset(axes)) | _compat.varying_axes(residual)
    nv = rv
    for p in params:
        nv = nv | _compat.varying_axes(p)
    return [_compat.with_varying_axes(x.update(weak_type=False), nv),
            _compat.with_varying_axes(residual.update(weak_type=False), rv)], \
        {_compat.NamedAxisEffect(a) for a in axes}


def _jvp(kind, primals, tangents, *, axes, algorithm, eps, invariant):
    x, residual, *params = primals
    tx, tres, *tparams = tangents
    normed, new_res = kind.prim.bind(x, residual, *params, axes=axes, algorithm=algorithm,
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
    tparams = [ad.instantiate_zeros(t) for t in tparams]
    _, t_normed = jax.jvp(functools.partial(_norm, eps=eps), (new_res, *params), (t_r, *tparams))
    return [normed, new_res], [t_normed, t_r]


def _batch(kind, axis_data, vals_in, dims_in, *, axes, algorithm, eps, invariant):
    params = dict(axes=axes, algorithm=algorithm, eps=eps, invariant=invariant)
    if axis_data.name in axes:
        raise NotImplementedError(
            f"jax_gin.{kind.api} over a vmapped axis is not supported; use jax_gin.psum and the "
            "norm")
    x, residual, *ps = vals_in
    dx, dres, *dps = dims_in
    if all(d is None for d in dims_in):
        # JAX calls this rule with no batched operand too (jacfwd's primal call)
        return kind.prim.bind(x, residual, *ps, **params), [None, None]
    size = axis_data.size
    x = jnp.broadcast_to(x, (size,) + x.shape) if dx is None else jnp.moveaxis(x, dx, 0)
    residual = (jnp.broadcast_to(residual, (size,) + residual.shape) if dres is None
                else jnp.moveaxis(residual, dres, 0))
    if all(d is None for d in dps):
        # every row of every batch element takes the same weight (and bias): the fused call
        return kind.prim.bind(x, residual, *ps, **params), [0, 0]
    # A weight (or bias) per batch element: the fused call with a weight of ones (and a bias of
    # -0.0, which adds exactly, -0.0 included), then the product with each row's weight and the
    # sum with its bias, each rounded as the native ones are (norm.h).
    d = x.shape[-1]
    identity = [jnp.ones((d,), x.dtype), jnp.full((d,), -0.0, x.dtype)][:len(ps)]
    if invariant:
        identity = [_vary_to(v, _compat.varying_axes(jax.typeof(p))) for v, p in zip(identity, ps)]
    normed, new_res = kind.prim.bind(x, residual, *identity, **params)
    shape = (size,) + (1,) * (x.ndim - 2) + (d,)
    per_row = [jnp.broadcast_to(p, (size, d)) if dp is None else jnp.moveaxis(p, dp, 0)
               for p, dp in zip(ps, dps)]
    normed = normed * per_row[0].reshape(shape)
    if len(per_row) > 1:
        # The product is rounded before the bias is added, as in the call: without the
        # barrier XLA contracts the two into one fused multiply-add, which rounds once.
        normed = lax.optimization_barrier(normed) + per_row[1].reshape(shape)
    return [normed, new_res], [0, 0]


def _lowering(kind, ctx, x, residual, *params, axes, algorithm, eps, invariant, platform):
    call = resolve_call(ctx, ctx.avals_in[:1], axes, "sum", algorithm, platform, kind.api)
    if call is None or call.partial:
        # `auto` chose XLA's all-reduce, or a partially-manual shard_map: the unfused composition
        return mlir.lower_fun(functools.partial(_unfused, axes=axes, algorithm=algorithm, eps=eps,
                                                invariant=invariant),
                              multiple_results=True)(ctx, x, residual, *params)
    check_no_open_start(ctx, kind.api)
    target = kind.cpu_target if platform == "cpu" else kind.cuda_target
    order = order_aval(platform)
    # the call's attributes (comm, algorithm and, on CPU, site) but its op: always a sum
    attrs = {k: v for k, v in call.attrs.items() if k != "op"}
    with call.named(kind.api, platform, 1, False):
        tok, normed, new_res = jax.ffi.ffi_lowering(target)(
            ctx.replace(avals_in=[TOKEN, order, *ctx.avals_in], avals_out=[order, *ctx.avals_out]),
            _compat.partition_id(), _chain_token(ctx, platform), x, residual, *params,
            eps=np.float32(eps), **attrs)
    _set_chain_token(ctx, tok, platform)
    return [normed, new_res]


def _impl(kind, *args, axes, **params):
    raise NameError(f"jax_gin.{kind.api} must be called inside jax.shard_map (axes {axes} are not "
                    "bound here)")


for _kind in KINDS:
    _kind.prim.def_impl(functools.partial(_impl, _kind))
    _kind.prim.def_effectful_abstract_eval(functools.partial(_abstract_eval, _kind))
    ad.primitive_jvps[_kind.prim] = functools.partial(_jvp, _kind)
    _compat.batching.fancy_primitive_batchers[_kind.prim] = functools.partial(_batch, _kind)
    # Not cacheable, for the order token chain (as allreduce_p).
    register_lowering(_kind.prim, functools.partial(_lowering, _kind), _kind.api)
