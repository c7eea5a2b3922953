"""psum_overlapping: an all-reduce that runs beside a given computation, placed by data
dependencies rather than by XLA's scheduler.

XLA schedules the start/done pair of `psum(..., overlap=True)` as it likes, and on GPUs it puts
the done right after the start (docs/overlap.md). Here the program itself fixes the order:

    starts (one per bucket; the kernels run on the side stream, one after another)
    optimization_barrier(start tokens, fn's inputs)   fn cannot begin before the starts
    ys = fn(*args)                                    on XLA's stream, beside the kernels
    done (every bucket's, and ys pass through)        the done cannot come before fn ends

Two primitives carry it: `jax_gin_allreduce_start` (one bucket) and `jax_gin_allreduce_dones`
(all buckets of one call, with ys). One done for all keeps the pair whole: JAX removes the done
only when nothing of it is used, and then the starts and fn go with it; XLA never removes the
done's custom calls (they have a side effect). Differentiation is a custom_vjp whose backward
is again psum_overlapping: the cotangent's all-reduce beside fn's backward (check_vma=False;
with check_vma=True a psum's transpose needs no communication).
"""
from __future__ import annotations

import math

import numpy as np

import jax
from jax import lax, tree_util
from jax.extend.core import Primitive, jaxprs_in_params
from jax.interpreters import mlir

from . import _compat, _native, _primitive, _runtime, _select
from ._primitive import TOKEN

API = "psum_overlapping"

start_p = Primitive("jax_gin_allreduce_start")
start_p.multiple_results = True
dones_p = Primitive("jax_gin_allreduce_dones")
dones_p.multiple_results = True


def psum_overlapping(x, axis_name, fn, *args, algorithm: str = "auto",
                     bucket_bytes: int | None = None, lanes: int | None = None):
    """``(jax_gin.psum(x, axis_name), fn(*args))``, with the all-reduce running while fn's
    computation runs.

    The all-reduce starts before fn's first operation and is joined after its last, whatever
    XLA's scheduler would prefer: on GPUs its kernel runs on a high-priority side stream with
    at most `lanes` CTAs (``jax_gin.runtime.settings.overlap_lanes`` by default), while XLA's
    stream runs fn. fn must not depend on psum's result (it cannot: it does not receive it) and
    must not call jax_gin's collectives itself; lax's collectives are fine. The results equal
    ``jax_gin.psum(x, axis_name, algorithm=algorithm)`` and ``fn(*args)`` bit for bit.

    Works under jit and in a shard_map without jit, under grad (reverse mode: the backward
    all-reduce runs beside fn's backward; reverse over reverse too, as in grad of a function
    of grad), vmap over axes other than the reduced ones, and scan. Forward-mode
    differentiation (jvp, jacfwd, jax.hessian) is not supported, as for any custom_vjp;
    jax.jacrev(jax.jacrev(f)) gives the Hessian. fn's arguments are traced: a Python value it
    uses as static goes in through a closure. A constant leaf of x is lax's constant sum, as
    in jax_gin.psum. docs/overlap.md gives the limits.
    """
    algorithm = _select.validate(algorithm, API)
    bucket_bytes = _primitive._check_bucket_bytes(bucket_bytes, API)
    axes = _primitive._normalize_axes(axis_name, API)
    if not callable(fn):
        raise TypeError(f"jax_gin.{API}: fn must be callable, got {type(fn).__name__}")
    if lanes is None:
        lanes = _runtime.settings.overlap_lanes
    if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or \
            not 1 <= lanes <= _runtime.MAX_LANES:
        raise ValueError(f"jax_gin.{API}: lanes must be an integer in [1, {_runtime.MAX_LANES}], "
                         f"got {lanes!r}")
    if not axes:
        return x, fn(*args)
    leaves, treedef = tree_util.tree_flatten(x)
    rest, merge = _primitive.constants_apart(leaves, axes, API)  # lax's, as jax_gin.psum's
    if merge is not None:
        sums, ys = psum_overlapping(rest, axes, fn, *args, algorithm=algorithm,
                                    bucket_bytes=bucket_bytes, lanes=lanes)
        return tree_util.tree_unflatten(treedef, merge(sums)), ys
    # Values that fn closes over (weights a layer uses) become arguments of its converted
    # form, so that the custom_vjp differentiates with respect to them too: JAX refuses to
    # differentiate a custom_vjp with respect to a closed-over value. The conversion traces fn
    # once; the pair then evaluates its jaxpr.
    fn, hoisted = jax.closure_convert(fn, *args)
    args = tuple(args) + tuple(hoisted)
    leaves, restore = _primitive.summed_as(leaves, API)
    leaves, out, by_dtype, _ = _primitive.group_leaves(leaves, axes, "sum", API)
    groups = []  # (indices of the leaves, typing mode) of each bucket, in order
    for (dtype, mode), idx in by_dtype.items():
        if mode == "unreduced":
            raise NotImplementedError(f"jax_gin.{API} of an unreduced value is not supported; "
                                      "use jax_gin.psum")
        sizes = [int(np.prod(np.shape(leaves[i]), dtype=np.int64)) * dtype.itemsize for i in idx]
        groups += [([idx[j] for j in b], mode) for b in _primitive.buckets(sizes, bucket_bytes)]
    if len(groups) > _native.ASYNC_SLOTS:
        raise ValueError(
            f"jax_gin.{API}: {len(groups)} buckets (one per dtype and bucket of at most "
            f"bucket_bytes and {_primitive.MAX_OPERANDS} leaves) are more than the "
            f"{_native.ASYNC_SLOTS} all-reduces one call can keep in flight; raise bucket_bytes "
            "if the buckets are small, or split the pytree over several calls")
    if not groups:  # no leaf to sum: fn alone, no pair
        return tree_util.tree_unflatten(treedef, restore(out)), fn(*args)
    # fn with effects that JAX keeps (a debug print) keeps the starts alive even where no
    # result of the pair is used; the done then stays too (_dones_dce)
    keep = _compat.has_kept_effects(jax.make_jaxpr(fn)(*args).effects)
    invariant = _compat.check_vma_enabled()
    params = dict(axes=axes, algorithm=algorithm, lanes=int(lanes))
    reduced = [leaves[i] for g, _ in groups for i in g]
    modes = tuple(m for _, m in groups)
    sizes = tuple(len(g) for g, _ in groups)
    # One jit around the pair: an eager shard_map (no jit around it) runs each primitive as
    # a program of its own, and a start's kernel must be joined by its done in the program
    # that started it. Inside a jit this is a nested call, which XLA inlines.
    pair = jax.jit(lambda r, a: _overlapped(r, fn, a, params, modes, sizes, invariant, keep))
    # The calls in fn's converted jaxpr, read from the pair's jaxpr; the call below reuses
    # that trace of the pair
    _refuse_calls_in(pair.trace(reduced, args).jaxpr.jaxpr, len(groups))
    sums, ys = pair(reduced, args)
    k = 0
    for g, _ in groups:
        for i in g:
            out[i] = sums[k]
            k += 1
    return tree_util.tree_unflatten(treedef, restore(out)), ys


def _overlapped(reduced, fn, args, params, modes, sizes, invariant, keep):
    """(the sums of `reduced`, fn(*args)) through the start/done primitives, differentiable in
    reverse mode to any order."""

    def run(reduced, args, f):
        toks, bufs, k = [], [], 0
        for slot, (mode, n) in enumerate(zip(modes, sizes)):
            tok, *b = start_p.bind(*reduced[k:k + n], invariant=mode, slot=slot, **params)
            toks.append(tok)
            bufs += b
            k += n
        toks, args = lax.optimization_barrier((toks, args))
        ys = f(*args)
        y_leaves, y_tree = tree_util.tree_flatten(ys)
        res = dones_p.bind(*toks, *bufs, *y_leaves, sizes=sizes, keep=keep, **params)
        return res[:len(bufs)], tree_util.tree_unflatten(y_tree, res[len(bufs):])

    @jax.custom_vjp
    def overlapped(reduced, args):
        return run(reduced, args, fn)

    def fwd(reduced, args):
        # through _overlapped, not run: a second reverse pass (jax.hessian's inner jacrev,
        # jacrev of jacrev) differentiates fwd, which its own custom_vjp then serves. fn's
        # pullback leaves that pair as its arrays, and its structure is rebuilt here: a
        # pullback's structure holds a function that each trace of fn makes anew, so the
        # pair's outputs, which a second pass compares between its traces, must not hold it.
        structure = []

        def fn_and_residuals(*a):
            ys, fn_vjp = jax.vjp(fn, *a)
            leaves, tree = tree_util.tree_flatten(fn_vjp)
            structure.append(tree)
            return ys, leaves

        sums, (ys, leaves) = _overlapped(reduced, fn_and_residuals, args, params, modes, sizes,
                                         invariant, keep)
        return (sums, ys), tree_util.tree_unflatten(structure[-1], leaves)

    def bwd(fn_vjp, cts):
        ct_sums, ct_ys = cts
        if invariant:
            # psum under check_vma: varying -> invariant; its transpose only re-marks the
            # cotangent as varying (no communication), as lax.psum's does.
            ct_red = [_compat.pcast_varying(c, params["axes"]) for c in ct_sums]
            return ct_red, fn_vjp(ct_ys)
        # An integer leaf's cotangent is float0 (no values): its bucket (one dtype) is not
        # summed, and the float0 cotangent is its input's.
        bounds = np.cumsum((0,) + sizes)
        summed = [b for b in range(len(sizes))
                  if jax.dtypes.result_type(ct_sums[bounds[b]]) != jax.dtypes.float0]
        if not summed:
            return list(ct_sums), fn_vjp(ct_ys)
        # fn_vjp (a pytree: its residuals) goes in as an operand, not closed over, so that a
        # second reverse pass can differentiate this pair too
        reds = [c for b in summed for c in ct_sums[bounds[b]:bounds[b + 1]]]
        # fn's backward may have effects that its forward has not (a custom_vjp's print)
        keep_bwd = _compat.has_kept_effects(
            jax.make_jaxpr(lambda f, c: f(c))(fn_vjp, ct_ys).effects)
        pair = jax.jit(lambda r, a: _overlapped(
            r, lambda f, c: f(c), a, params, tuple(modes[b] for b in summed),
            tuple(sizes[b] for b in summed), invariant, keep_bwd))
        # fn's backward runs beside the cotangent's all-reduce: no jax_gin call in it either
        _refuse_calls_in(pair.trace(reds, (fn_vjp, ct_ys)).jaxpr.jaxpr, len(summed),
                         backward=True)
        ct_red, ct_args = pair(reds, (fn_vjp, ct_ys))
        ct_red, out = iter(ct_red), list(ct_sums)
        for b in summed:
            for i in range(bounds[b], bounds[b + 1]):
                out[i] = next(ct_red)
        return out, ct_args

    overlapped.defvjp(fwd, bwd)
    return overlapped(reduced, args)


def _refuse_calls_in(jaxpr, starts: int, backward: bool = False) -> None:
    """A ValueError if `jaxpr`, a pair of `starts` starts and their done around fn, holds a
    jax_gin call of fn's: on a GPU it would run on XLA's stream while the starts' kernels run
    on the side stream, and two calls of one communicator must never run at once. Nested jitted
    functions count: one that the program lowered before is not lowered again inside fn, so the
    lowering check (_primitive.check_no_open_start) does not see its calls. Calls over axes of
    one device, or over no mesh axis (a vmap's), launch nothing and are let through.
    `backward`: the pair of the backward pass (check_vma=False), beside fn's backward."""
    calls = [e for e in _equations(jaxpr) if e.primitive in _primitive.COLLECTIVE_PRIMITIVES
             and _launches(e.params.get("axes", ()))]
    own = {start_p: starts, dones_p: 1}  # the pair's
    for e in calls:
        if own.get(e.primitive, 0) > 0:
            own[e.primitive] -= 1
            continue
        if backward:
            raise ValueError(
                f"jax_gin.{API}: the backward pass of the function it runs beside the "
                f"all-reduce calls a jax_gin collective (primitive {e.primitive.name}), which "
                "would run while the cotangent's all-reduce is in flight; use jax.lax's "
                "collectives in that backward pass, or shard_map's check_vma=True (whose "
                "backward pass of a psum needs no all-reduce)")
        raise ValueError(
            f"jax_gin.{API}: the function it runs beside the all-reduce calls a jax_gin "
            f"collective (primitive {e.primitive.name}), which would run while the all-reduce "
            "is in flight; call it before or after psum_overlapping, or use jax.lax's "
            "collectives there")


def _equations(jaxpr):
    """`jaxpr`'s equations, and those of its sub-jaxprs, depth first."""
    for e in jaxpr.eqns:
        yield e
        for sub in jaxprs_in_params(e.params):
            yield from _equations(sub)


def _launches(axes) -> bool:
    """Whether a call over `axes` has more than one rank over the manual mesh axes."""
    manual = _compat.manual_mesh_axes()
    return math.prod(_compat.axis_size(a) for a in axes if a in manual) > 1


# ---------------------------------------------------------------------------------------
# Rules


def _start_abstract_eval(*avals, axes, algorithm, invariant, slot, lanes):
    outs, effects = _primitive._abstract_eval(*avals, axes=axes, op="sum", algorithm=algorithm,
                                              invariant=invariant, overlap=True)
    return [TOKEN, *outs], effects


def _dones_abstract_eval(*avals, sizes, keep, axes, algorithm, lanes):
    return list(avals[len(sizes):])


def _dones_dce(used_outputs, eqn):
    """JAX's dead-code elimination of a done: where none of its results is used it goes, and
    fn and the starts with it, unless fn has effects that JAX keeps (`keep`): they keep the
    optimization barrier, and so the starts, alive, and a start must never lose its done."""
    if not any(used_outputs) and not eqn.params["keep"]:
        return [False] * len(eqn.invars), None
    return [True] * len(eqn.invars), eqn


def _start_batch(axis_data, vals_in, dims_in, **params):
    if axis_data.name in params["axes"]:
        raise NotImplementedError(f"jax_gin.{API} under a vmap over a reduced axis")
    return start_p.bind(*vals_in, **params), [None, *dims_in]


def _dones_batch(axis_data, vals_in, dims_in, *, sizes, **params):
    n = len(sizes)
    if any(d is not None for d in dims_in[:n]):
        raise NotImplementedError(f"jax_gin.{API}: a batched order token")
    return dones_p.bind(*vals_in, sizes=sizes, **params), list(dims_in[n:])


def _start_lowering(ctx, *xs, axes, algorithm, invariant, slot, lanes, platform):
    call = _primitive.resolve_call(ctx, ctx.avals_in, axes, "sum", algorithm, platform, API)
    if call is not None:  # (XLA's own all-reduce, or none over one device, may run beside)
        _primitive.check_no_open_start(ctx, API, own=slot)  # the call's earlier buckets
    _open(ctx).append(call)
    if call is None:  # XLA's own all-reduce, which XLA runs asynchronously itself
        return [mlir.ir_constant(np.uint32(0)),
                *_primitive.xla_allreduce(ctx.replace(avals_out=ctx.avals_out[1:]), xs, "sum",
                                          axes)]
    if call.partial:  # a partially-manual shard_map: synchronous (see _lower_partial)
        tok = mlir.ir_constant(np.uint32(0))
        return [tok, *_primitive._lower_partial(ctx.replace(avals_out=ctx.avals_out[1:]), xs,
                                                platform, call.attrs)]
    with call.named(API, platform, len(xs), True):
        tok, outs = _primitive.lower_start(ctx, xs, ctx.avals_in, ctx.avals_out[1:], call,
                                           platform, slot, lanes)
    if platform == "cpu":  # the order token is an HLO token there (lower_done takes it back)
        tok = mlir.ir_constant(np.uint32(0))
    return [tok, *outs]


def _dones_lowering(ctx, *ops, sizes, keep, axes, algorithm, lanes, platform):
    opened = _open(ctx)
    n = len(sizes)  # (at least 1: psum_overlapping makes no pair without a bucket)
    calls = opened[len(opened) - n:]
    del opened[len(opened) - n:]
    toks, rest, avals = ops[:n], list(ops[n:]), list(ctx.avals_in[n:])
    nbufs = sum(sizes)
    bufs, ys = rest[:nbufs], rest[nbufs:]
    b_avals, y_avals = avals[:nbufs], avals[nbufs:]
    out, k = [], 0
    for slot, (size, call, tok) in enumerate(zip(sizes, calls, toks)):
        mine, mine_avals = bufs[k:k + size], b_avals[k:k + size]
        k += size
        if call is None or call.partial:  # nothing in flight
            out += mine
            continue
        # ys pass through every done, so that each done comes after fn's last operation
        with call.named(API, platform, size, True):
            res = _primitive.lower_done(ctx, tok, [*mine, *ys], [*mine_avals, *y_avals], call,
                                        platform, slot, has_side_effect=True)
        out += res[:size]
        ys = res[size:]
    return [*out, *ys]


def _open(ctx) -> list:
    """The starts lowered whose dones are not (see _primitive.check_no_open_start)."""
    return _primitive._open_starts(ctx)


def _impl(*xs, **params):
    raise NameError(f"jax_gin.{API} must be called inside jax.shard_map "
                    f"(axes {params['axes']} are not bound here)")


start_p.def_impl(_impl)
dones_p.def_impl(_impl)
start_p.def_effectful_abstract_eval(_start_abstract_eval)
dones_p.def_abstract_eval(_dones_abstract_eval)
_compat.batching.fancy_primitive_batchers[start_p] = _start_batch
_compat.batching.fancy_primitive_batchers[dones_p] = _dones_batch
_primitive.register_lowering(start_p, _start_lowering, API)
_primitive.register_lowering(dones_p, _dones_lowering, API)
_compat.register_dce_rule(dones_p, _dones_dce)
