"""Global-view operations for jit/pjit: contractions and reductions whose all-reduce is jax_gin's.

Under jit with globally sharded arrays the all-reduce is implicit: the partitioner inserts
one whenever a contraction or a reduction runs over a sharded dimension. Each operation here
is a `jax.experimental.custom_partitioning` op with a Shardy sharding rule. Its partition
function gives each device its local partial result and all-reduces the partials with
jax_gin.psum / pmax / pmin over exactly the mesh axes that shard the reduced dimensions. So
the compiled program holds jax_gin's custom call where XLA's all-reduce would be, and when
no reduced dimension is sharded, no collective runs at all.

    einsum(subscripts, x, w)    two operands, explicit output ("bk,kn->bn")
    matmul(x, w)                x (..., k) @ w (k, n)
    sum / mean / max / min      (x, axis=None, keepdims=False)

Each is differentiable: custom_partitioning has no AD rules, so each op is wrapped in
custom_vjp. The backward passes are built from the same operations, so a backward
contraction over a sharded dimension also all-reduces with jax_gin. Examples are the weight
gradient of a data-parallel layer and the input gradient of a column-parallel one. vmap
makes its batch dimension one more dimension of the same op (custom_vmap), so per-example
gradients and jax.jacrev work too.

Mesh axis types:
- Auto axes go straight to the partitioner.
- Explicit axes become Auto around the op, through jax.sharding.auto_axes. The result then
  gets the sharding that the sharding rule implies: the reduced dimensions lose their
  sharding, and the others keep the first operand's. `out_sharding=` overrides it.
- Inside jax.shard_map the ops are jnp's, gradients included. Where every axis is manual they
  compute on the local block and never communicate (use jax_gin.psum there); where axes are
  left free (axis_names=), XLA partitions them over the free axes with its own collectives
  (custom_partitioning has no mesh there).
"""
from __future__ import annotations

import builtins
import functools
import math
import string

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, get_abstract_mesh

from . import _compat
from ._ops import OP_API_NAMES, check_dtype
from ._primitive import pmax, pmin, psum
from . import _select

__all__ = ["einsum", "matmul", "sum", "mean", "max", "min"]

_ALLREDUCE = {"sum": psum, "max": pmax, "min": pmin}
_LOCAL = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


# ---------------------------------------------------------------------------------------
# Sharding helpers: which mesh axes shard which factor (dimension letter)


def _entry_axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry: None, a name, or a tuple of names."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def _padded_spec(spec, ndim: int) -> tuple:
    spec = tuple(spec) if spec is not None else ()
    return spec + (None,) * (ndim - len(spec))


def _assign_factors(operands, specs, sizes: dict, mesh_shape: dict) -> dict:
    """Choose one sharding per factor: factor -> tuple of mesh axes.

    A factor takes the axes of the first operand that shards it. Each mesh axis shards at
    most one factor, and the axes must divide the factor's size: a tuple keeps its longest
    prefix that does.
    """
    chosen, used = {}, set()
    for factors, spec in zip(operands, specs):
        for f, entry in zip(factors, _padded_spec(spec, len(factors))):
            if chosen.get(f):
                continue
            axes, prod = [], 1
            for a in _entry_axes(entry):
                n = int(mesh_shape.get(a, 1))
                if a in used or sizes[f] % (prod * n):
                    break
                axes.append(a)
                prod *= n
            if axes:
                chosen[f] = tuple(axes)
                used.update(axes)
    return chosen


def _spec_for(factors, chosen: dict) -> P:
    out = []
    for f in factors:
        axes = chosen.get(f, ())
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _reduced_axes(reduced_factors, chosen: dict, mesh_shape: dict) -> tuple:
    """The mesh axes that shard a reduced factor, in mesh order: the all-reduce's axes.
    Axes of size 1 need no communication and are left out."""
    axes = {a for f in reduced_factors for a in chosen.get(f, ())}
    return tuple(a for a, n in mesh_shape.items() if a in axes and n > 1)


def _named_specs(api: str, mesh, arg_shapes, mesh_axes: tuple):
    """The partition's mesh and each operand's PartitionSpec. Where the partitioner knows no
    mesh (a jit whose arrays are all made inside it, under a context mesh), it gives
    GSPMDShardings: they are read over the mesh of the trace (`mesh_axes`: its names and
    sizes) on their devices."""
    specs = []
    decode = mesh.empty and bool(mesh_axes)
    for a in arg_shapes:
        sharding = a.sharding
        if decode and not isinstance(sharding, NamedSharding):
            named = _compat.gspmd_as_named(sharding, *zip(*mesh_axes))
            if named is not None:
                mesh, sharding = named.mesh, named
        if isinstance(sharding, NamedSharding):
            specs.append(sharding.spec)
        elif sharding.is_fully_replicated:
            # a constant or a value with no mesh (a closed-over array, say): replicated,
            # so no mesh axis shards it
            specs.append(P())
        else:
            raise NotImplementedError(
                f"jax_gin.{api}: the partitioner gave an operand sharding that is not a "
                f"NamedSharding ({type(sharding).__name__}) and no mesh to read it over; "
                "shard the inputs with NamedSharding over a jax.sharding.Mesh")
    return mesh, specs


def _trace_mesh_axes(*xs) -> tuple:
    """The (name, size) pairs of the mesh of xs or the context, for _named_specs."""
    m = _mesh_of(*xs)
    return () if m is None or m.empty else tuple(zip(m.axis_names, m.axis_sizes))


def _in_shard_map() -> bool:
    """Inside jax.shard_map (some mesh axes manual): the ops are jnp's there. Fully manual,
    that is the local block's op; with axes left free (axis_names=), XLA partitions it over
    them with its own collectives, as jax_gin's collectives run XLA's own there (a
    custom_partitioning op knows no mesh there). Before any custom_vjp, so that gradients
    are jnp's too, with their varying-axes types."""
    return bool(_compat.manual_mesh_axes())


def _place(y, out_sharding):
    """y with `out_sharding`, where one is given."""
    if out_sharding is None:
        return y
    return (jax.sharding.reshard(y, out_sharding) if _explicit_mode(y)
            else jax.lax.with_sharding_constraint(y, out_sharding))


def _rule_string(operands, result) -> str:
    return ", ".join(" ".join(fs) for fs in operands) + " -> " + " ".join(result)


# ---------------------------------------------------------------------------------------
# Explicit mesh axes: run the op with them switched to Auto


def _explicit_axes(*xs) -> tuple:
    """Mesh axes of type Explicit in the types of xs (or the context mesh), in mesh order."""
    meshes = [jax.typeof(x).sharding.mesh for x in xs] + [get_abstract_mesh()]
    for m in meshes:
        if m is not None and not m.empty:
            return tuple(a for a, t in zip(m.axis_names, m.axis_types) if t == AxisType.Explicit)
    return ()


def _type_spec(x) -> tuple:
    return _padded_spec(jax.typeof(x).sharding.spec, jnp.ndim(x))


def _mesh_of(*xs):
    for x in xs:
        m = jax.typeof(x).sharding.mesh
        if m is not None and not m.empty:
            return m
    return get_abstract_mesh()


def _run(api, op, args, out_factors, operand_factors, sizes, out_sharding):
    """Call the custom-partitioned `op`, through auto_axes when the mesh has Explicit axes."""
    explicit = _explicit_axes(*args)
    if not explicit:
        y = op(*args)
        if out_sharding is not None:
            y = jax.lax.with_sharding_constraint(y, out_sharding)
        return y
    mesh = _mesh_of(*args)
    if out_sharding is None:
        # The sharding the rule implies, as a typed program would expect it.
        chosen = _assign_factors(operand_factors, [_type_spec(a) for a in args], sizes,
                                 dict(zip(mesh.axis_names, mesh.axis_sizes)))
        out_sharding = _spec_for(out_factors, chosen)
    if isinstance(out_sharding, P):
        out_sharding = NamedSharding(mesh, out_sharding)
    try:
        return jax.sharding.auto_axes(op, axes=explicit, out_sharding=out_sharding)(*args)
    except NotImplementedError as e:  # pragma: no cover - depends on the JAX release
        raise NotImplementedError(
            f"jax_gin.{api}: could not switch the Explicit mesh axes {explicit} to Auto "
            f"({e}); build the mesh with Auto axes instead: "
            f"jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * n)") from e


def _explicit_mode(*xs) -> bool:
    return bool(_explicit_axes(*xs))


def _like(ct, x):
    """Give a cotangent x's sharding type under Explicit axes (a no-op under Auto)."""
    if _explicit_mode(x):
        sharding = jax.typeof(x).sharding
        # x not on the mesh (a plain array) is replicated on it: P() under the context mesh
        return jax.sharding.reshard(ct, P() if sharding.mesh.empty else sharding)
    return ct


def _batched_sharding(out_sharding):
    """A result sharding for the unbatched result, given to the batched one: vmap's new
    leading dimension is left unconstrained (None)."""
    if out_sharding is None:
        return None
    if isinstance(out_sharding, NamedSharding):
        return NamedSharding(out_sharding.mesh, P(None, *out_sharding.spec))
    return P(None, *out_sharding)


# ---------------------------------------------------------------------------------------
# The custom-partitioned kernels: contraction and reduction
#
# custom_partitioning has no batching rule, so each kernel's call is a custom_vmap whose
# rule turns vmap's batch dimension into one more dimension of the same operation: a new
# letter in every batched operand and in the output of a contraction, one more kept
# dimension in a reduction. The batched call is the same custom-partitioned op, so it is
# partitioned and all-reduced alike; vmap inside vmap nests the rule. jax.jacrev batches the
# backward pass, so it rests on this too.


def _parse_einsum(subscripts: str):
    if not isinstance(subscripts, str) or "->" not in subscripts or "." in subscripts:
        raise ValueError(
            f"jax_gin.einsum: subscripts must name every dimension and the output, as in "
            f"'bk,kn->bn' (no '...'); got {subscripts!r}")
    lhs, out = subscripts.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        raise ValueError(f"jax_gin.einsum takes exactly two operands; got {subscripts!r}")
    for s in (*ins, out):
        other = [c for c in s if c not in string.ascii_letters]
        if other:
            raise ValueError(f"jax_gin.einsum: subscripts are letters (a-z, A-Z); "
                             f"{other[0]!r} is none, in {subscripts!r}")
        if len(set(s)) != len(s):
            raise ValueError(
                f"jax_gin.einsum: each operand and the output need distinct letters "
                f"(no traces or diagonals); got {subscripts!r}")
    xs, ws = ins
    for c in out:
        if c not in xs and c not in ws:
            raise ValueError(f"jax_gin.einsum: output letter {c!r} is in no operand: {subscripts!r}")
    for c in set(xs) ^ set(ws):
        if c not in out:
            raise ValueError(
                f"jax_gin.einsum: letter {c!r} appears in one operand only and not in the "
                f"output; sum it out first (jax_gin.sum): {subscripts!r}")
    return xs, ws, out


@functools.partial(custom_partitioning, static_argnums=(2, 3, 4, 5, 6))
def _contract_op(x, w, subscripts, algorithm, precision, preferred, mesh_axes):
    return jnp.einsum(subscripts, x, w, precision=precision, preferred_element_type=preferred)


def _contract_rule(subscripts, algorithm, precision, preferred, mesh_axes, mesh, value_types,
                   result_types):
    xs, ws, out = _parse_einsum(subscripts)
    reduced = tuple(c for c in dict.fromkeys(xs + ws) if c not in out)
    return _rule_string((xs, ws), out), {"reduction_factors": reduced}


def _contract_partition(subscripts, algorithm, precision, preferred, mesh_axes, mesh, arg_shapes,
                        result_shape):
    xs, ws, out = _parse_einsum(subscripts)
    mesh, specs = _named_specs("einsum", mesh, arg_shapes, mesh_axes)
    sizes = {**dict(zip(xs, arg_shapes[0].shape)), **dict(zip(ws, arg_shapes[1].shape))}
    chosen = _assign_factors((xs, ws), specs, sizes, dict(mesh.shape))
    reduce_axes = _reduced_axes([c for c in sizes if c not in out], chosen, dict(mesh.shape))

    def lower_fn(x, w):
        # this device's partial product
        y = jnp.einsum(subscripts, x, w, precision=precision, preferred_element_type=preferred)
        return psum(y, reduce_axes, algorithm=algorithm) if reduce_axes else y

    arg_shardings = tuple(NamedSharding(mesh, _spec_for(fs, chosen)) for fs in (xs, ws))
    return mesh, lower_fn, NamedSharding(mesh, _spec_for(out, chosen)), arg_shardings


_contract_op.def_partition(_contract_partition, sharding_rule=_contract_rule)


def _reduce_factors(ndim: int, axes: tuple):
    names = [f"d{i}" for i in range(ndim)]
    return names, [n for i, n in enumerate(names) if i not in axes]


@functools.partial(custom_partitioning, static_argnums=(1, 2, 3, 4))
def _reduce_op(x, axes, op, algorithm, mesh_axes):
    return _LOCAL[op](x, axis=axes)


def _reduce_rule(axes, op, algorithm, mesh_axes, mesh, value_types, result_types):
    names, kept = _reduce_factors(len(value_types[0].shape), axes)
    return _rule_string((names,), kept), {"reduction_factors": tuple(names[i] for i in axes)}


def _reduce_partition(axes, op, algorithm, mesh_axes, mesh, arg_shapes, result_shape):
    names, kept = _reduce_factors(len(arg_shapes[0].shape), axes)
    mesh, specs = _named_specs(op, mesh, arg_shapes, mesh_axes)
    sizes = dict(zip(names, arg_shapes[0].shape))
    chosen = _assign_factors((names,), specs, sizes, dict(mesh.shape))
    reduce_axes = _reduced_axes([names[i] for i in axes], chosen, dict(mesh.shape))

    def lower_fn(x):
        y = _LOCAL[op](x, axis=axes)  # this device's partial reduction
        return _ALLREDUCE[op](y, reduce_axes, algorithm=algorithm) if reduce_axes else y

    return (mesh, lower_fn, NamedSharding(mesh, _spec_for(kept, chosen)),
            (NamedSharding(mesh, _spec_for(names, chosen)),))


_reduce_op.def_partition(_reduce_partition, sharding_rule=_reduce_rule)


# ---------------------------------------------------------------------------------------
# Differentiable contraction: einsum and matmul


def _contract(subscripts, x, w, algorithm, precision, preferred, out_sharding, api):
    """The custom-partitioned contraction, batchable (see above)."""

    @jax.custom_batching.custom_vmap
    def call(x, w):
        xs, ws, out = _parse_einsum(subscripts)
        sizes = {**dict(zip(xs, x.shape)), **dict(zip(ws, w.shape))}
        op = lambda a, b: _contract_op(a, b, subscripts, algorithm, precision, preferred,  # noqa: E731
                                       _trace_mesh_axes(x, w))
        return _run(api, op, (x, w), out, (xs, ws), sizes, out_sharding)

    @call.def_vmap
    def _(axis_size, in_batched, x, w):
        xs, ws, out = _parse_einsum(subscripts)
        free = [c for c in string.ascii_letters if c not in xs + ws]
        if not free:
            raise ValueError(f"jax_gin.{api}: vmap needs a dimension letter, and "
                             f"{subscripts!r} uses all 52")
        z = free[0]
        xb, wb = in_batched
        batched = f"{z + xs if xb else xs},{z + ws if wb else ws}->{z + out}"
        return _contract(batched, x, w, algorithm, precision, preferred,
                         _batched_sharding(out_sharding), api), True

    return call(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5, 6, 7))
def _einsum(subscripts, x, w, algorithm, precision, preferred, out_sharding, api):
    return _contract(subscripts, x, w, algorithm, precision, preferred, out_sharding, api)


def _einsum_fwd(subscripts, x, w, algorithm, precision, preferred, out_sharding, api):
    return _einsum(subscripts, x, w, algorithm, precision, preferred, out_sharding, api), (x, w)


def _einsum_bwd(subscripts, algorithm, precision, preferred, out_sharding, api, res, g):
    x, w = res
    xs, ws, out = _parse_einsum(subscripts)
    # dx contracts g with w over the letters of w missing from x; dw likewise. Each is a
    # jax_gin contraction, so a sharded contracted dimension all-reduces with jax_gin. g keeps
    # its dtype (a preferred_element_type's), and each result is rounded to its operand's
    # dtype after the contraction, as lax.dot_general's transpose does.
    dx = _einsum(f"{out},{ws}->{xs}", g, w, algorithm, precision, preferred, None, api)
    dw = _einsum(f"{xs},{out}->{ws}", x, g, algorithm, precision, preferred, None, api)
    return _like(dx.astype(x.dtype), x), _like(dw.astype(w.dtype), w)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def einsum(subscripts: str, x, w, *, algorithm: str = "auto", precision=None,
           preferred_element_type=None, out_sharding=None):
    """Two-operand einsum whose sharded contractions all-reduce with jax_gin.

    `subscripts` names every dimension and the output (``"bk,kn->bn"``, ``"bsd,df->bsf"``).
    Each letter is in at least two of x, w and the output. Letters that are missing from
    the output are contracted. When the partitioner shards a contracted dimension over some
    mesh axes, each device contracts its blocks, and jax_gin.psum sums the partials over
    those axes. `out_sharding` (a NamedSharding, or a PartitionSpec under jax.set_mesh)
    fixes the result's sharding. `precision` and `preferred_element_type` are jnp.einsum's; the all-reduce runs
    in the result's dtype, as XLA's own would.
    """
    return _einsum_checked(subscripts, x, w, algorithm, precision, preferred_element_type,
                           out_sharding, "einsum")


def _broadcast_letters(subscripts, x, w, api):
    """x and w with each dimension of size 1 whose letter the output keeps and the other
    operand has at another size broadcast to it: jnp.einsum's broadcasting (the products are
    the same), made explicit because the partitioned contraction takes one size per letter
    (a letter's dimensions are sharded alike); JAX's gradient of the broadcast sums the
    cotangent back. A ValueError for a contracted letter of two sizes, which jnp.einsum sums
    out of the larger operand first, for other sizes that differ, and for an operand whose
    rank its subscripts do not give."""
    xs, ws, out = _parse_einsum(subscripts)
    for letters, v, name in ((xs, x, "x"), (ws, w, "w")):
        if len(letters) != v.ndim:
            raise ValueError(f"jax_gin.{api}: subscripts {letters!r} give {name} "
                             f"{len(letters)} dimensions, but it has shape {v.shape}")
    size = {}
    for letters, v in ((xs, x), (ws, w)):
        for c, n in zip(letters, v.shape):
            if size.get(c, n) != n:
                if 1 not in (n, size[c]):
                    raise ValueError(f"jax_gin.{api}: letter {c!r} has sizes {size[c]} and {n} "
                                     f"in {subscripts!r} (only a size of 1 broadcasts)")
                if c not in out:
                    raise ValueError(
                        f"jax_gin.{api}: contracted letter {c!r} has sizes {size[c]} and {n} "
                        f"in {subscripts!r}; sum the larger operand over it first "
                        f"(jax_gin.sum) and drop the letter from both, as jnp.einsum does")
            size[c] = n if size.get(c, 1) == 1 else size[c]  # (1 broadcasts, to 0 too)
    return tuple(v if all(n == size[c] for c, n in zip(letters, v.shape)) else
                 jnp.broadcast_to(v, tuple(size[c] for c in letters))
                 for letters, v in ((xs, x), (ws, w)))


def _einsum_checked(subscripts, x, w, algorithm, precision, preferred_element_type,
                    out_sharding, api):
    """einsum after the checks that name `api` (einsum, or matmul, which calls it)."""
    _parse_einsum(subscripts)
    _select.validate(algorithm, api)
    x, w = jnp.asarray(x), jnp.asarray(w)
    dtype = jnp.result_type(x, w)
    x, w = x.astype(dtype), w.astype(dtype)
    preferred = None if preferred_element_type is None else np.dtype(preferred_element_type)
    check_dtype(dtype if preferred is None else preferred, "psum", api)
    subscripts = subscripts.replace(" ", "")
    if _in_shard_map():
        return _place(jnp.einsum(subscripts, x, w, precision=precision,
                                 preferred_element_type=preferred), out_sharding)
    x, w = _broadcast_letters(subscripts, x, w, api)
    return _einsum(subscripts, x, w, algorithm, precision, preferred, out_sharding, api)


def matmul(x, w, *, algorithm: str = "auto", precision=None, preferred_element_type=None,
           out_sharding=None):
    """``x @ w`` for x of shape (..., k) and w of shape (k, n), with jax_gin's all-reduce.

    For a row-parallel (tensor-parallel) layer: with k sharded over "tensor", each device
    multiplies its blocks, and jax_gin sums the partial products over "tensor". The
    gradients are contractions too: the weight gradient contracts the batch dimensions, so
    a data-parallel batch all-reduces them with jax_gin.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    if w.ndim != 2 or x.ndim < 1:
        raise ValueError(
            f"jax_gin.matmul: x must be (..., k) and w (k, n); got shapes {x.shape} and "
            f"{w.shape} (use jax_gin.einsum for other contractions)")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"jax_gin.matmul: contraction sizes differ: {x.shape} @ {w.shape}")
    letters = [c for c in string.ascii_letters if c not in "kn"]
    if x.ndim - 1 > len(letters):
        raise ValueError(f"jax_gin.matmul: too many dimensions: {x.shape}")
    batch = "".join(letters[: x.ndim - 1])
    return _einsum_checked(f"{batch}k,kn->{batch}n", x, w, algorithm, precision,
                           preferred_element_type, out_sharding, "matmul")


# ---------------------------------------------------------------------------------------
# Differentiable reductions: sum, mean, max, min


def _normalize_axis(axis, ndim: int, api: str) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    if not isinstance(axis, (tuple, list)) and not _compat.is_tracer(axis) and \
            np.ndim(axis) == 1:  # a 1-D array of axes, as jnp takes it
        axis = tuple(np.asarray(axis).tolist())
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        try:
            a = _compat.concrete_int(a)
        except TypeError:
            raise TypeError(f"jax_gin.{api}: axis must be an integer or a tuple of integers, "
                            f"got {axis!r}") from None
        if not -ndim <= a < ndim:
            raise ValueError(f"jax_gin.{api}: axis {a} is out of bounds for {ndim} dimensions")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"jax_gin.{api}: repeated axis in {axis!r}")
    return tuple(sorted(out))


def _reduce_raw(x, axes, op, algorithm, out_sharding, api):
    """The custom-partitioned reduction, batchable (see above)."""

    @jax.custom_batching.custom_vmap
    def call(x):
        names, kept = _reduce_factors(x.ndim, axes)
        sizes = dict(zip(names, x.shape))
        fn = lambda a: _reduce_op(a, axes, op, algorithm, _trace_mesh_axes(x))  # noqa: E731
        return _run(api, fn, (x,), kept, (names,), sizes, out_sharding)

    @call.def_vmap
    def _(axis_size, in_batched, x):
        # x is batched (its only operand): the batch dimension leads and is kept.
        return _reduce_raw(x, tuple(a + 1 for a in axes), op, algorithm,
                           _batched_sharding(out_sharding), api), True

    return call(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _reduce(x, axes, op, algorithm, out_sharding, api):
    return _reduce_raw(x, axes, op, algorithm, out_sharding, api)


def _reduce_fwd(x, axes, op, algorithm, out_sharding, api):
    # through _reduce itself, so that a second reverse pass (grad of grad) differentiates it
    y = _reduce(x, axes, op, algorithm, out_sharding, api)
    return y, (x, y)


def _broadcast_back(v, x, axes):
    """v (x with `axes` reduced away) broadcast back to x's shape (and sharding)."""
    return _like(jnp.broadcast_to(jnp.expand_dims(v, axes), x.shape), x)


def _reduce_bwd(axes, op, algorithm, out_sharding, api, res, g):
    x, y = res
    if op == "sum":
        return (_broadcast_back(g, x, axes),)
    # max/min: ties share the cotangent equally, exactly as jnp.max's derivative does. The
    # number of ties is a sum over the reduced (maybe sharded) dimensions: a jax_gin sum.
    hit = (x == _broadcast_back(y, x, axes)).astype(g.dtype)
    counts = _reduce(hit, axes, "sum", algorithm, None, api)
    return (_broadcast_back(g / counts, x, axes) * hit,)


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def _computation_dtype(dtype):
    """float16 and bfloat16 reduce in float32, as in jnp.sum and jnp.mean."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in (np.dtype(jnp.bfloat16), np.dtype(np.float16)) else dtype


def _reduction(x, axis, keepdims, op, algorithm, out_sharding, api):
    _select.validate(algorithm, api)
    x = jnp.asarray(x)
    axes = _normalize_axis(axis, x.ndim, api)
    if op == "sum":
        # Sum as jnp.sum does: small integers and bool widen to the default integer;
        # float16 and bfloat16 are summed (and all-reduced) in float32, then rounded back.
        out_dtype = jax.eval_shape(lambda v: jnp.sum(v, axis=axes), x).dtype
        comp_dtype = _computation_dtype(out_dtype)
    else:
        out_dtype = comp_dtype = x.dtype
    # (under x64 jnp.sum widens unsigned integers to uint64, which jax_gin.psum sums as int64)
    check_dtype(comp_dtype, OP_API_NAMES[op], api)
    if not axes:
        y = x.astype(out_dtype)
    elif _in_shard_map():
        y = _place(_LOCAL[op](x.astype(comp_dtype), axis=axes),
                   None if keepdims else out_sharding).astype(out_dtype)
    else:
        y = _reduce(x.astype(comp_dtype), axes, op, algorithm, None if keepdims else out_sharding,
                    api)
        y = y.astype(out_dtype)
    if keepdims:
        y = jnp.expand_dims(y, axes)
    # (a reduction over no axis makes no call, which would have placed y)
    if keepdims or not axes:
        y = _place(y, out_sharding)
    return y


def sum(x, axis=None, *, keepdims: bool = False, algorithm: str = "auto", out_sharding=None):
    """``jnp.sum(x, axis, keepdims=...)``, all-reduced with jax_gin when `axis` is sharded.

    Each device sums its block, and jax_gin.psum adds the partial sums over the mesh axes
    that shard the reduced dimensions. The dtypes follow jnp.sum: float16 and bfloat16 sum
    in float32.
    """
    return _reduction(x, axis, keepdims, "sum", algorithm, out_sharding, "sum")


def mean(x, axis=None, *, keepdims: bool = False, algorithm: str = "auto", out_sharding=None):
    """``jnp.mean``: a jax_gin `sum` divided by the global count, with jnp.mean's dtypes."""
    _select.validate(algorithm, "mean")
    x = jnp.asarray(x)
    axes = _normalize_axis(axis, x.ndim, "mean")
    result_dtype = jax.eval_shape(lambda v: jnp.mean(v, axis=axes), x).dtype
    comp_dtype = _computation_dtype(result_dtype)
    check_dtype(comp_dtype, "psum", "mean")
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        # nothing to reduce and so nothing to communicate: jnp's NaNs, whose bits a division
        # 0 / 0 at run time would not give (x86 makes it a NaN with the sign bit set)
        return _place(jnp.mean(x, axis=axes, keepdims=keepdims), out_sharding)
    s = _reduction(x.astype(comp_dtype), axes, keepdims, "sum", algorithm, out_sharding, "mean")
    return jax.lax.div(s, jnp.asarray(count, comp_dtype)).astype(result_dtype)


def max(x, axis=None, *, keepdims: bool = False, algorithm: str = "auto", out_sharding=None):
    """``jnp.max``, all-reduced with jax_gin.pmax when `axis` is sharded; ties share the
    gradient equally, as in jnp."""
    return _reduction(x, axis, keepdims, "max", algorithm, out_sharding, "max")


def min(x, axis=None, *, keepdims: bool = False, algorithm: str = "auto", out_sharding=None):
    """``jnp.min``, all-reduced with jax_gin.pmin when `axis` is sharded."""
    return _reduction(x, axis, keepdims, "min", algorithm, out_sharding, "min")
