"""Whole steps of real workloads, timed with lax's collectives, with jax_gin's and with none.

    python -m jax_gin.bench --workload dp-train     # or fsdp, tp-train, tp-decode, overlap; --help

docs/performance.md: an op that wins in a chain can lose in a step. Each step here is written
once, as a function of `reduce`, and built as each of its variants (Workload.variants):
  lax       jax.lax.psum
  jax_gin   jax_gin.psum (with `algorithm=`)
  none      the identity: the compute-only baseline. Its numbers are wrong; its time is what
            the compute costs, so step - compute-only is the communication a step exposes.
tp-decode has a fourth, jax_gin_fused: each psum with the residual add and RMSNorm after it
is one jax_gin.psum_add_rmsnorm. fsdp's collectives are all-gathers and their transposes,
reduce-scatters: lax.all_gather, jax_gin.all_gather, or for none local copies and slices of
the same shapes (`gatherer`). overlap has variants of its own (below).

The workloads (jax.jit of jax.shard_map, bfloat16 by default):
  dp-train   GPT-style training step, data-parallel over the mesh axis "data": embeddings,
             L pre-norm (RMSNorm) blocks of attention and MLP, tied output head,
             cross-entropy; the per-device gradients (9 leaves per block + 3) are
             all-reduced by one pytree call, psum(grads, "data") (a custom call per
             bucket of 64 MiB and 64 leaves), then SGD.
  fsdp       dp-train's model, step and sizes, fully sharded over "data": each device
             holds 1/n of one flat vector per block (and of one for the embeddings and final
             norm). The loss all-gathers (tiled) each block's vector before the block, and
             jax.grad transposes each all-gather into a reduce-scatter of the gradients; SGD
             updates the local 1/n.
  tp-train   Megatron tensor-parallel training step over the axis "tensor": column-parallel
             QKV and MLP-up, row-parallel attention-out and MLP-down, a psum after each
             row-parallel matmul: 2 psums per block forward, 2 backward (their transposes).
  tp-decode  Llama-shaped tensor-parallel decode step (forward only): one new token per
             sequence attends to a cached context; SwiGLU MLP; 2 psums per block, each
             followed by the residual add and an RMSNorm.
  overlap    the overlap probe, over the axis "data": `layers` dependent matmuls
             (rows, d) @ (d, d) with tanh between them, and an all-reduce of `mib` MiB per
             device that does not depend on them, in one program. Its variants are
             OVERLAP_VARIANTS: compute (the matmuls only), lax_alone and jax_gin_alone (the
             all-reduce only), lax and jax_gin (both). overlap = together / max(compute
             alone, all-reduce alone): 1 when the all-reduce hides entirely behind the
             matmuls or they behind it, 2 when the two run one after the other.

Inputs are deterministic (jax.random with a fixed seed; for a given global shape the same
values on any mesh), and the variants of a step run on the very same arrays.
`measure` compiles the variants, counts the collectives in their compiled HLO, times them in
turns and compares lax's results with jax_gin's; `main` is the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_gin
from . import _runtime
from ._select import COLLECTIVE_ALGORITHMS
from ._trace import _check_writable

DATA, TENSOR = "data", "tensor"
REDUCES = ("none", "lax", "jax_gin")   # the order of every turn
FUSED = "jax_gin_fused"   # tp-decode's variant with jax_gin.psum_add_rmsnorm
# The variants whose results are compared (result["<a>_vs_<b>"]), in the report's order.
COMPARED = (("lax", "jax_gin"), ("lax", FUSED), ("lax_alone", "jax_gin_alone"))


def reducer(reduce: str, algorithm: str = "auto", overlap: bool = False) -> Callable:
    """(pytree, axis_name) -> pytree: the all-reduce sum a step is built with (jax_gin: with
    psum's `overlap`)."""
    if reduce == "lax":
        return jax.lax.psum
    if reduce in ("jax_gin", FUSED):
        return functools.partial(jax_gin.psum, algorithm=algorithm, overlap=overlap)
    if reduce == "none":
        return lambda tree, axis_name: tree
    raise ValueError(f"reduce must be one of {', '.join(REDUCES + (FUSED,))}, got {reduce!r}")


# ---------------------------------------------------------------------------------------
# Sizes and inputs


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    d_model: int
    heads: int
    ffn: int        # MLP hidden size
    seq: int        # sequence length; tp-decode: length of the cached context
    batch: int      # sequences; dp-train: per device; tp-decode: tokens decoded, one per sequence
    vocab: int = 0  # dp-train and fsdp only
    rows: int = 0   # overlap only: rows of the matmuls' input per device
    mib: float = 0  # overlap only: MiB all-reduced per device
    dtype: str = "bfloat16"
    lr: float = 1e-2
    overlap: bool = False  # the jax_gin variants call psum(..., overlap=True); in `overlap`,
    #                        the together variant is psum_overlapping(g, chain of matmuls)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One input array: global shape, PartitionSpec, and values: `normal` (times scale),
    `ones`, `zeros`, `tokens` (int32 in [0, scale)), or `ints` (integers in [-scale, scale)
    in the array's dtype)."""
    shape: tuple
    spec: P
    init: str = "normal"
    scale: float = 1.0


def materialize(mesh: Mesh, layout, dtype, seed: int = 0):
    """The arrays of a pytree of Leaf, made on the devices with their shardings. Leaf i draws
    from fold_in(key(seed), i), and JAX's partitionable threefry makes the values the same
    for any mesh. One small program per kind of leaf (shape, init, sharding), called once per
    leaf: one program for all leaves of a 32-layer model takes minutes to compile."""
    leaves, treedef = jax.tree.flatten(layout)
    key = jax.random.key(seed)
    out = [_leaf_maker(leaf.shape, np.dtype(dtype).name, leaf.init, float(leaf.scale),
                       NamedSharding(mesh, leaf.spec))(key, np.int32(i))
           for i, leaf in enumerate(leaves)]
    return treedef.unflatten(out)


@functools.lru_cache(maxsize=None)
def _leaf_maker(shape, dtype, init, scale, sharding):
    def make(key, i):
        k = jax.random.fold_in(key, i)
        if init == "normal":
            return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        if init == "ones":
            return jnp.ones(shape, dtype)
        if init == "zeros":
            return jnp.zeros(shape, dtype)
        if init == "tokens":
            return jax.random.randint(k, shape, 0, int(scale), jnp.int32)
        if init == "ints":
            s = int(scale)
            return jax.random.randint(k, shape, -s, s, jnp.int32).astype(dtype)
        raise ValueError(f"unknown init {init!r}")
    return jax.jit(make, out_shardings=sharding)


def specs(layout):
    """The PartitionSpecs of a pytree of Leaf, for shard_map's in_specs."""
    return jax.tree.map(lambda leaf: leaf.spec, layout)


def _norm(x, scale=None, eps: float = 1e-6):
    """RMSNorm, statistics in float32."""
    x32 = x.astype(jnp.float32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)
    return y if scale is None else y * scale


def _sgd(params, grads, lr: float):
    def update(p, g):
        return (p.astype(jnp.float32) - lr * g.astype(jnp.float32)).astype(p.dtype)
    return jax.tree.map(update, params, grads)


# Every step below is a shard_map with check_vma=False, for two reasons.
# - With check_vma=True, JAX inserts a pvary wherever a replicated value meets a per-device
#   one, and the transpose of pvary is lax's own psum (psum_invariant). The backward pass
#   would then hold lax all-reduces whichever `reduce` the step was built with.
# - The `none` variant returns per-device values where the others return replicated ones;
#   only an unchecked out_specs=P() accepts both.


# ---------------------------------------------------------------------------------------
# dp-train: GPT-style data-parallel training step


def gpt_layout(cfg: Config) -> dict:
    """GPT parameters, replicated: 9 leaves per block, plus the embeddings and final norm."""
    d, f, rep = cfg.d_model, cfg.ffn, P()
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)

    def block():
        return {"ln1": Leaf((d,), rep, "ones"),
                "qkv": Leaf((d, 3 * d), rep, "normal", std), "bqkv": Leaf((3 * d,), rep, "zeros"),
                "o": Leaf((d, d), rep, "normal", out_std), "bo": Leaf((d,), rep, "zeros"),
                "ln2": Leaf((d,), rep, "ones"),
                "fc1": Leaf((d, f), rep, "normal", std), "b1": Leaf((f,), rep, "zeros"),
                "fc2": Leaf((f, d), rep, "normal", out_std)}

    return {"emb": Leaf((cfg.vocab, d), rep, "normal", std),
            "pos": Leaf((cfg.seq, d), rep, "normal", 0.01),
            "lnf": Leaf((d,), rep, "ones"),
            "layers": [block() for _ in range(cfg.layers)]}


def gpt_embed(top, tokens):
    """The input of the first block: token and position embeddings of tokens (batch, seq).
    top: the parameters outside the blocks (emb, pos, lnf)."""
    return top["emb"][tokens] + top["pos"][:tokens.shape[1]]


def gpt_block(x, p, heads: int):
    """One pre-norm block (attention, then MLP) on x (batch, seq, d)."""
    b, s, _ = x.shape
    h = _norm(x, p["ln1"])
    q, k, v = (t.reshape(b, s, heads, -1) for t in jnp.split(h @ p["qkv"] + p["bqkv"], 3, -1))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, -1)
    x = x + a @ p["o"] + p["bo"]
    h = _norm(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["fc1"] + p["b1"]) @ p["fc2"]


def gpt_head(x, top, tokens):
    """Mean next-token cross-entropy of the last block's output x; the head is tied to emb."""
    logits = (_norm(x, top["lnf"]) @ top["emb"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def gpt_loss(params, tokens, heads: int):
    """Mean next-token cross-entropy of a GPT on tokens (batch, seq)."""
    x = gpt_embed(params, tokens)
    for p in params["layers"]:
        x = gpt_block(x, p, heads)
    return gpt_head(x, params, tokens)


def dp_train_inputs(mesh: Mesh, cfg: Config, seed: int = 0) -> tuple:
    """(params, tokens): replicated parameters; `batch` sequences per device."""
    n = mesh.shape[DATA]
    tokens = Leaf((n * cfg.batch, cfg.seq), P(DATA), "tokens", cfg.vocab)
    return tuple(materialize(mesh, (gpt_layout(cfg), tokens), cfg.dtype, seed))


def dp_train_step(mesh: Mesh, cfg: Config, reduce: str = "jax_gin", algorithm: str = "auto"):
    """jit(step)(params, tokens) -> (params, per-device loss)."""
    psum, n = reducer(reduce, algorithm, cfg.overlap), mesh.shape[DATA]

    def step(params, tokens):
        loss, grads = jax.value_and_grad(gpt_loss)(params, tokens, cfg.heads)
        grads = psum(grads, DATA)                     # every gradient, one psum (a call per bucket)
        return _sgd(params, grads, cfg.lr / n), loss[None]

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(DATA)),
                                 out_specs=(P(), P(DATA)), check_vma=False))


def dp_train_psums(cfg: Config, n: int) -> dict:
    leaves = jax.tree.leaves(gpt_layout(cfg))
    nbytes = sum(math.prod(leaf.shape) for leaf in leaves) * jnp.dtype(cfg.dtype).itemsize
    return {"calls": 1, "bytes": nbytes, "leaves": len(leaves),
            "text": f"1 psum of the gradient pytree ({len(leaves)} leaves, {_mib(nbytes)})"}


# ---------------------------------------------------------------------------------------
# fsdp: fully sharded data-parallel training step


def gatherer(reduce: str, algorithm: str = "auto") -> Callable:
    """(x, axis_name) -> the tiled all-gather of x along dim 0, the one collective an fsdp
    step writes; jax.grad transposes it into the tiled psum_scatter of the cotangent. none:
    n copies of x, transposed into this device's block of the cotangent: the shapes and the
    compute of both collectives without their communication."""
    if reduce == "lax":
        return functools.partial(jax.lax.all_gather, axis=0, tiled=True)
    if reduce == "jax_gin":
        return functools.partial(jax_gin.all_gather, axis=0, tiled=True, algorithm=algorithm)
    if reduce == "none":
        return _local_gather
    raise ValueError(f"reduce must be one of {', '.join(REDUCES)}, got {reduce!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _local_gather(x, axis_name):
    return jnp.tile(x, (jax.lax.axis_size(axis_name),) + (1,) * (x.ndim - 1))


def _local_gather_fwd(x, axis_name):
    return _local_gather(x, axis_name), None


def _local_gather_bwd(axis_name, _, ct):
    # the block at axis_index, not a fixed one: XLA could otherwise skip computing the
    # gradients that fall in the other blocks
    m = ct.shape[0] // jax.lax.axis_size(axis_name)
    return (jax.lax.dynamic_slice_in_dim(ct, jax.lax.axis_index(axis_name) * m, m),)


_local_gather.defvjp(_local_gather_fwd, _local_gather_bwd)


def fsdp_groups(cfg: Config) -> tuple:
    """(top, block): the GPT parameters (gpt_layout) that an fsdp step gathers at once: those
    outside the blocks (emb, pos, lnf), and those of one block (every block alike)."""
    layout = gpt_layout(cfg)
    return {k: v for k, v in layout.items() if k != "layers"}, layout["layers"][0]


def fsdp_size(group, n: int) -> int:
    """Elements of a group's flat vector: its parameters, padded to a multiple of 16 n. Each
    device's 1/n is then whole 16-byte vectors (jax_gin's kernels move 16-byte vectors; no
    padding around the call) for any dtype."""
    size = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(group))
    return -(-size // (16 * n)) * 16 * n


def fsdp_pack(arrays, size: int):
    """A group's arrays, raveled in pytree order and concatenated, padded with zeros to size."""
    flat = jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(arrays)])
    return jnp.pad(flat, (0, size - flat.shape[0]))


def fsdp_unpack(flat, group):
    """The arrays of a group (a pytree of Leaf: their shapes) from its flat vector."""
    leaves, treedef = jax.tree.flatten(group)
    out, offset = [], 0
    for leaf in leaves:
        k = math.prod(leaf.shape)
        out.append(flat[offset:offset + k].reshape(leaf.shape))
        offset += k
    return treedef.unflatten(out)


def fsdp_params(shards, cfg: Config) -> dict:
    """The GPT parameters (as gpt_layout) of fsdp's global flat vectors: the inverse of the
    packing in fsdp_inputs."""
    top, block = fsdp_groups(cfg)
    return {**fsdp_unpack(shards["top"], top),
            "layers": [fsdp_unpack(s, block) for s in shards["layers"]]}


def fsdp_inputs(mesh: Mesh, cfg: Config, seed: int = 0) -> tuple:
    """(shards, tokens): dp-train's parameters and tokens, the parameters packed into one flat
    vector per group, {"top": ..., "layers": [one per block]}, split over "data": each device
    holds 1/n of every group."""
    n = mesh.shape[DATA]
    params, tokens = dp_train_inputs(mesh, cfg, seed)
    top, block = fsdp_groups(cfg)
    pack = jax.jit(fsdp_pack, static_argnums=1, out_shardings=NamedSharding(mesh, P(DATA)))
    shards = {"top": pack({k: params[k] for k in top}, fsdp_size(top, n)),
              "layers": [pack(p, fsdp_size(block, n)) for p in params["layers"]]}
    return shards, tokens


def fsdp_train_step(mesh: Mesh, cfg: Config, reduce: str = "jax_gin", algorithm: str = "auto"):
    """jit(step)(shards, tokens) -> (shards, per-device loss): dp-train's model and update,
    with every parameter sharded.

    The loss gathers each group where it is used: the top group once (for the embeddings,
    and the tied head at the end), each block's right before the block. jax.grad, taken with
    respect to the shards, transposes each all-gather into a reduce-scatter: each device
    receives the sum over the devices of the gradient of its own 1/n, and updates only that.
    Per step: layers + 1 all-gathers and layers + 1 reduce-scatters. The backward pass uses
    the blocks' parameters as gathered in the forward pass (XLA keeps them); it does not
    gather them again, as a jax.checkpoint around each block would (tests/test_order.py runs
    that form).
    """
    gather, n = gatherer(reduce, algorithm), mesh.shape[DATA]
    top, block = fsdp_groups(cfg)

    def loss_fn(shards, tokens):
        t = fsdp_unpack(gather(shards["top"], DATA), top)
        x = gpt_embed(t, tokens)
        for shard in shards["layers"]:
            x = gpt_block(x, fsdp_unpack(gather(shard, DATA), block), cfg.heads)
        return gpt_head(x, t, tokens)

    def step(shards, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(shards, tokens)   # grads: reduce-scattered
        return _sgd(shards, grads, cfg.lr / n), loss[None]

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(DATA), P(DATA)),
                                 out_specs=(P(DATA), P(DATA)), check_vma=False))


def fsdp_train_psums(cfg: Config, n: int) -> dict:
    top, block = fsdp_groups(cfg)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    nbytes, top_bytes = fsdp_size(block, n) * itemsize, fsdp_size(top, n) * itemsize
    calls = cfg.layers + 1
    return {"calls": 2 * calls, "bytes": nbytes,
            "text": f"{calls} all-gathers and {calls} reduce-scatters (tiled): {_mib(nbytes)} "
                    f"per block, {_mib(top_bytes)} for the embeddings and final norm"}


# ---------------------------------------------------------------------------------------
# tp-train: Megatron tensor-parallel training step


def megatron_layout(cfg: Config, swiglu: bool = False) -> list:
    """Per block: QKV and MLP-up (and gate) column-parallel, attention-out and MLP-down
    row-parallel, split by heads and by MLP columns over "tensor"."""
    d, h, hd, f = cfg.d_model, cfg.heads, cfg.head_dim, cfg.ffn
    out = 1 / math.sqrt(2 * cfg.layers)
    col, row = P(None, TENSOR), P(TENSOR, None)

    def block():
        b = {"qkv": Leaf((d, 3, h, hd), P(None, None, TENSOR, None), "normal", 1 / math.sqrt(d)),
             "o": Leaf((h, hd, d), P(TENSOR, None, None), "normal", out / math.sqrt(d)),
             "up": Leaf((d, f), col, "normal", 1 / math.sqrt(d)),
             "down": Leaf((f, d), row, "normal", out / math.sqrt(f))}
        if swiglu:
            b["gate"] = Leaf((d, f), col, "normal", 1 / math.sqrt(d))
        return b

    return [block() for _ in range(cfg.layers)]


def megatron_block(x, p, psum):
    """One pre-norm block on x (batch, seq, d), replicated; p holds this device's shards."""
    q, k, v = jnp.einsum("bsd,dthe->tbshe", _norm(x), p["qkv"])   # column-parallel: local heads
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + psum(jnp.einsum("bshe,hed->bsd", a, p["o"]), TENSOR)   # row-parallel: partial sums
    h = jax.nn.gelu(_norm(x) @ p["up"])                             # column-parallel
    return x + psum(h @ p["down"], TENSOR)                          # row-parallel


def tp_train_inputs(mesh: Mesh, cfg: Config, seed: int = 0) -> tuple:
    """(blocks, x, y): sharded weights; replicated input activations and regression targets."""
    act = Leaf((cfg.batch, cfg.seq, cfg.d_model), P())
    return tuple(materialize(mesh, (megatron_layout(cfg), act, act), cfg.dtype, seed))


def tp_train_step(mesh: Mesh, cfg: Config, reduce: str = "jax_gin", algorithm: str = "auto"):
    """jit(step)(blocks, x, y) -> (blocks, loss).

    Under check_vma=False the transpose of psum is psum, so the backward pass holds one
    all-reduce per forward one, made by the same `reduce`: 2 per block forward and 2
    backward, Megatron's count. (Under check_vma=True psum's transpose is a pcast, and the
    backward all-reduces would come from the transposes of JAX's pvarys: lax's psum.) In
    this form the cotangent of a replicated activation is held as a sum over the devices,
    so the loss is divided by n: psum's transpose then sums n shares of it, and every
    weight gradient is exact. The norms have no learned scale: a replicated parameter's
    gradient would be such a share, and need one more all-reduce.
    """
    psum, n = reducer(reduce, algorithm, cfg.overlap), mesh.shape[TENSOR]
    layout = megatron_layout(cfg)

    def loss_fn(blocks, x, y):
        for p in blocks:
            x = megatron_block(x, p, psum)
        err = _norm(x).astype(jnp.float32) - y.astype(jnp.float32)
        return jnp.mean(err * err)

    def step(blocks, x, y):
        share, grads = jax.value_and_grad(lambda b: loss_fn(b, x, y) / n)(blocks)
        return _sgd(blocks, grads, cfg.lr), share * n

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs(layout), P(), P()),
                                 out_specs=(specs(layout), P()), check_vma=False))


def tp_train_psums(cfg: Config, n: int) -> dict:
    nbytes = cfg.batch * cfg.seq * cfg.d_model * jnp.dtype(cfg.dtype).itemsize
    return {"calls": 4 * cfg.layers, "bytes": nbytes,
            "text": f"{4 * cfg.layers} psums of {_mib(nbytes)} "
                    f"({2 * cfg.layers} forward, {2 * cfg.layers} backward)"}


# ---------------------------------------------------------------------------------------
# tp-decode: Llama-shaped tensor-parallel decode step


def llama_layout(cfg: Config) -> tuple:
    """(params, cache): Megatron-split blocks with SwiGLU and RMSNorm scales, and a cached
    context of keys and values per block, split by heads."""
    d, rep = cfg.d_model, P()
    blocks = megatron_layout(cfg, swiglu=True)
    for b in blocks:
        b["ln1"], b["ln2"] = Leaf((d,), rep, "ones"), Leaf((d,), rep, "ones")
    kv = Leaf((cfg.batch, cfg.seq, cfg.heads, cfg.head_dim), P(None, None, TENSOR, None))
    return {"layers": blocks, "lnf": Leaf((d,), rep, "ones")}, [{"k": kv, "v": kv} for _ in blocks]


def llama_decode(params, cache, x, psum, add_norm=None):
    """The normed hidden states (batch, d) after all blocks, for one new token per sequence
    whose input hidden state is x (batch, d). No rotary embedding; the cache is read only.
    add_norm(y, x, scale) -> (normed, x + psum(y)) replaces each psum with its residual add
    and the RMSNorm after it (jax_gin.psum_add_rmsnorm)."""
    blocks = params["layers"]
    if add_norm is None:
        def add_norm(y, x, scale):
            x = x + psum(y, TENSOR)
            return _norm(x, scale), x
    h = _norm(x, blocks[0]["ln1"])
    for i, (p, kv) in enumerate(zip(blocks, cache)):
        q, k, v = jnp.einsum("bd,dthe->tbhe", h, p["qkv"])           # column-parallel: local heads
        keys = jnp.concatenate([kv["k"], k[:, None]], axis=1)          # the context and this token
        values = jnp.concatenate([kv["v"], v[:, None]], axis=1)
        a = jax.nn.dot_product_attention(q[:, None], keys, values)[:, 0]
        h, x = add_norm(jnp.einsum("bhe,hed->bd", a, p["o"]), x, p["ln2"])  # row-parallel
        m = jax.nn.silu(h @ p["gate"]) * (h @ p["up"])                  # column-parallel
        h, x = add_norm(m @ p["down"], x,                               # row-parallel
                        blocks[i + 1]["ln1"] if i + 1 < len(blocks) else params["lnf"])
    return h


def tp_decode_inputs(mesh: Mesh, cfg: Config, seed: int = 0) -> tuple:
    """(params, cache, x)."""
    params, cache = llama_layout(cfg)
    x = Leaf((cfg.batch, cfg.d_model), P())
    return tuple(materialize(mesh, (params, cache, x), cfg.dtype, seed))


def tp_decode_step(mesh: Mesh, cfg: Config, reduce: str = "jax_gin", algorithm: str = "auto"):
    """jit(step)(params, cache, x) -> normed hidden states (batch, d). reduce="jax_gin_fused":
    every psum with its residual add and RMSNorm is one jax_gin.psum_add_rmsnorm."""
    psum = reducer(reduce, algorithm, cfg.overlap)
    params, cache = llama_layout(cfg)
    add_norm = None
    if reduce == FUSED:
        def add_norm(y, x, scale):
            return jax_gin.psum_add_rmsnorm(y, x, scale, TENSOR, algorithm=algorithm)

    def step(params, cache, x):
        return llama_decode(params, cache, x, psum, add_norm)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs(params), specs(cache), P()),
                                 out_specs=P(), check_vma=False))


def tp_decode_psums(cfg: Config, n: int) -> dict:
    nbytes = cfg.batch * cfg.d_model * jnp.dtype(cfg.dtype).itemsize
    return {"calls": 2 * cfg.layers, "bytes": nbytes,
            "text": f"{2 * cfg.layers} psums of {_kib(nbytes)}"}


# ---------------------------------------------------------------------------------------
# overlap: a matmul chain beside an independent all-reduce


OVERLAP_VARIANTS = ("compute", "lax_alone", "jax_gin_alone", "lax", "jax_gin")
OVERLAP_TARGET = 1.1   # the overlap figure a good all-reduce reaches or beats


def overlap_elements(cfg: Config) -> int:
    """Elements all-reduced per device: `mib` MiB of `dtype`."""
    return int(cfg.mib * 2**20) // jnp.dtype(cfg.dtype).itemsize


def overlap_inputs(mesh: Mesh, cfg: Config, seed: int = 0) -> tuple:
    """(x, w, g): the matmul chain's input, `rows` per device; its weight, replicated; the
    all-reduce's input, per device, integers in [-4, 4): their sum over up to 32 devices is
    exact in bfloat16, float16 and float32, whatever the order of the additions."""
    n, d = mesh.shape[DATA], cfg.d_model
    layout = (Leaf((n * cfg.rows, d), P(DATA)), Leaf((d, d), P(), "normal", 1 / math.sqrt(d)),
              Leaf((n * overlap_elements(cfg),), P(DATA), "ints", 4))
    return tuple(materialize(mesh, layout, cfg.dtype, seed))


def overlap_step(mesh: Mesh, cfg: Config, reduce: str = "jax_gin", algorithm: str = "auto"):
    """jit(step)(x, w, g) -> a dict of what the variant `reduce` computes: "y", the chain of
    `layers` matmuls y = tanh(y @ w) from y = x (compute, lax, jax_gin); "sum", the all-reduce
    of g by lax.psum (lax_alone, lax) or jax_gin.psum (jax_gin_alone, jax_gin). Neither
    depends on the other; a variant returns no input, so none pays for a copy."""
    if reduce not in OVERLAP_VARIANTS:
        raise ValueError(f"overlap's variants are {', '.join(OVERLAP_VARIANTS)}, got {reduce!r}")
    matmuls = reduce in ("compute", "lax", "jax_gin")
    psum = None if reduce == "compute" else \
        reducer(reduce.removesuffix("_alone"), algorithm, cfg.overlap)

    def chain(x, w):
        for _ in range(cfg.layers):
            x = jnp.tanh(x @ w)
        return x

    def step(x, w, g):
        out = {}
        if reduce == "jax_gin" and cfg.overlap:
            # the all-reduce placed beside the chain by data dependencies
            out["sum"], out["y"] = jax_gin.psum_overlapping(g, DATA, chain, x, w,
                                                            algorithm=algorithm)
            return out
        if matmuls:
            out["y"] = chain(x, w)
        if psum is not None:
            out["sum"] = psum(g, DATA)
        return out

    out_specs = {"y": P(DATA), "sum": P()}
    out_specs = {k: v for k, v in out_specs.items()
                 if (k == "y" and matmuls) or (k == "sum" and psum is not None)}
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(DATA), P(), P(DATA)),
                                 out_specs=out_specs, check_vma=False))


def overlap_psums(cfg: Config, n: int) -> dict:
    nbytes = overlap_elements(cfg) * jnp.dtype(cfg.dtype).itemsize
    return {"calls": 1, "bytes": nbytes,
            "text": f"1 psum of {_mib(nbytes)}, independent of {cfg.layers} matmuls "
                    f"({cfg.rows} x {cfg.d_model}) @ ({cfg.d_model} x {cfg.d_model}) with tanh"}


# ---------------------------------------------------------------------------------------
# The registry


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    axis: str
    step: Callable     # (mesh, cfg, reduce, algorithm) -> jitted step
    inputs: Callable   # (mesh, cfg, seed) -> the step's arguments
    psums: Callable    # (cfg, n) -> {"calls", "bytes", "text"}: the psum calls one step makes
    gpu: Config        # default sizes on GPUs
    cpu: Config        # default sizes on CPU devices (tiny)
    tensor_parallel: bool
    variants: tuple = REDUCES   # the `reduce` values of `step`, in the order of every turn
    baseline: str = "none"      # the compute-only variant: exposed = step - its step
    checked: Callable = lambda out: out   # the part of a step's output lax and jax_gin share
    xla_ops: tuple = ("all_reduce",)     # the XLA collectives of lax's step (count_collectives)
    algorithms: tuple = jax_gin.ALGORITHMS   # the algorithms its jax_gin collectives take
    attention: bool = True   # its step calls jax.nn.dot_product_attention (check_dtype)


WORKLOADS = {
    "dp-train": Workload(
        "dp-train", DATA, dp_train_step, dp_train_inputs, dp_train_psums,
        gpu=Config(layers=12, d_model=1024, heads=16, ffn=4096, seq=1024, batch=8, vocab=50304),
        cpu=Config(layers=2, d_model=64, heads=4, ffn=256, seq=16, batch=2, vocab=128),
        tensor_parallel=False),
    "fsdp": Workload(
        "fsdp", DATA, fsdp_train_step, fsdp_inputs, fsdp_train_psums,
        gpu=Config(layers=12, d_model=1024, heads=16, ffn=4096, seq=1024, batch=8, vocab=50304),
        cpu=Config(layers=2, d_model=64, heads=4, ffn=256, seq=16, batch=2, vocab=128),
        tensor_parallel=False, xla_ops=("all_gather", "reduce_scatter"),
        algorithms=COLLECTIVE_ALGORITHMS),
    "tp-train": Workload(
        "tp-train", TENSOR, tp_train_step, tp_train_inputs, tp_train_psums,
        gpu=Config(layers=16, d_model=4096, heads=32, ffn=16384, seq=1024, batch=1),
        cpu=Config(layers=2, d_model=64, heads=8, ffn=256, seq=16, batch=1),
        tensor_parallel=True),
    "tp-decode": Workload(
        "tp-decode", TENSOR, tp_decode_step, tp_decode_inputs, tp_decode_psums,
        gpu=Config(layers=32, d_model=4096, heads=32, ffn=11008, seq=512, batch=8),
        cpu=Config(layers=2, d_model=64, heads=8, ffn=256, seq=16, batch=8),
        tensor_parallel=True, variants=REDUCES + (FUSED,)),
    "overlap": Workload(
        "overlap", DATA, overlap_step, overlap_inputs, overlap_psums,
        gpu=Config(layers=8, d_model=4096, heads=1, ffn=0, seq=0, batch=0, rows=4096, mib=256),
        cpu=Config(layers=8, d_model=128, heads=1, ffn=0, seq=0, batch=0, rows=16, mib=0.25),
        tensor_parallel=False, variants=OVERLAP_VARIANTS, baseline="compute",
        checked=lambda out: out["sum"], attention=False),
}
NAMES = tuple(WORKLOADS)


def default_config(workload: str, platform: str = "cpu", **overrides) -> Config:
    """The default sizes for the platform ('cpu': tiny; any other: GPU sizes), with the
    overrides that are not None. A new d_model without heads or ffn keeps the default head
    size and MLP ratio."""
    w = WORKLOADS[workload]
    base = w.cpu if platform == "cpu" else w.gpu
    given = {k: v for k, v in overrides.items() if v is not None}
    if "d_model" in given:
        if "heads" not in given:
            d, hd = given["d_model"], base.head_dim
            heads = given["heads"] = max(1, d // hd)
            # Tensor parallel splits the heads over the devices, so they keep the default size:
            # a narrower d_model as one head would make check_config hint at widths that this
            # rule then splits into other heads.
            if w.tensor_parallel and d % hd:
                raise ValueError(f"d_model {d} is not a multiple of {hd}, the default head "
                                 f"size (heads = d_model // {hd} unless --heads gives them)")
            if d % heads:
                raise ValueError(f"d_model {d} is not a multiple of heads {heads}, which are "
                                 f"d_model // {hd} (the default head size) unless --heads "
                                 "gives them")
        given.setdefault("ffn", base.ffn * given["d_model"] // base.d_model)
    return dataclasses.replace(base, **given)


# The size options of the command line, each a Config field of the same name.
SIZE_OPTIONS = ("layers", "d_model", "heads", "ffn", "seq", "batch", "vocab", "rows", "mib",
                "dtype")


def reads(workload: str) -> tuple:
    """The SIZE_OPTIONS that `workload`'s step reads (check_config checks them)."""
    if workload == "overlap":  # a chain of `layers` d_model-wide matmuls beside an all-reduce
        return ("layers", "d_model", "rows", "mib", "dtype")
    model = ("layers", "d_model", "heads", "ffn", "seq", "batch")
    return model + (("vocab",) if workload in ("dp-train", "fsdp") else ()) + ("dtype",)


def check_config(workload: str, cfg: Config, n: int) -> None:
    """Raises ValueError when the sizes do not fit the workload on n devices."""
    # the integer sizes that the step reads (vocab and rows: checked below)
    used = [name for name in reads(workload) if name not in ("vocab", "rows", "mib", "dtype")]
    small = [f"{name.replace('_', '-')} {getattr(cfg, name)}" for name in used
             if getattr(cfg, name) < 1]
    if small:
        raise ValueError(f"{workload} needs sizes of at least 1: got {', '.join(small)}")
    if cfg.d_model % cfg.heads:
        raise ValueError(f"d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
    if WORKLOADS[workload].tensor_parallel and (cfg.heads % n or cfg.ffn % n):
        raise ValueError(f"{workload} splits heads ({cfg.heads}) and ffn ({cfg.ffn}) over "
                         f"{n} devices: both must be multiples of {n} (with heads of size "
                         f"{cfg.head_dim}: d_model a multiple of {cfg.head_dim * n})")
    if workload in ("dp-train", "fsdp") and cfg.vocab < 1:
        raise ValueError(f"{workload} needs vocab >= 1")
    ops = WORKLOADS[workload].xla_ops
    if cfg.overlap and "all_reduce" not in ops:
        raise ValueError(f"--overlap makes the jax_gin variants' psum asynchronous, and "
                         f"{workload}'s step has no psum (its collectives: "
                         f"{', '.join(op.replace('_', '-') for op in ops)})")
    if workload == "overlap" and (cfg.rows < 1 or cfg.layers < 1 or overlap_elements(cfg) < 1):
        raise ValueError("overlap needs rows >= 1, layers >= 1 and mib >= one element")


def check_dtype(workload: str, dtype: str, platform: str) -> None:
    """Raises ValueError for a dtype that the workload's step cannot compile in on `platform`
    (a jax.Device.platform): XLA's CPU dot_general has no float16 x float16 -> float32
    precision (F16_F16_F32), which jax.nn.dot_product_attention asks for."""
    if platform == "cpu" and dtype == "float16" and WORKLOADS[workload].attention:
        raise ValueError(f"{workload}: --dtype float16 does not run on cpu devices (XLA's CPU "
                         "dot_general has no float16 x float16 -> float32 precision, which "
                         "its attention needs); use bfloat16 or float32 there, float16 on GPUs")


def make_mesh(workload: str, devices=None) -> Mesh:
    """A 1-D mesh over `devices` (default all) with the workload's axis name."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), (WORKLOADS[workload].axis,))


# ---------------------------------------------------------------------------------------
# Measuring


_XLA_OPS = {op: re.compile(rf"\b{op.replace('_', '-')}(?:-start)?\(")
            for op in ("all_reduce", "all_gather", "reduce_scatter")}
_GIN_CALL = re.compile(r'custom_call_target="[^"]*jax_gin[^"]*"')


def count_collectives(hlo_text: str) -> dict:
    """XLA's all-reduce, all-gather and reduce-scatter ops (or their -start when async) and
    jax_gin custom calls in compiled HLO text."""
    return {**{op: len(pattern.findall(hlo_text)) for op, pattern in _XLA_OPS.items()},
            "jax_gin_calls": len(_GIN_CALL.findall(hlo_text))}


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")) \
        if jnp.issubdtype(x.dtype, jnp.floating) else x


@jax.jit
def _differences(a, b):
    equal = [jnp.all(_bits(x) == _bits(y)) for x, y in zip(a, b)]
    diff = [jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) for x, y in zip(a, b)]
    return jnp.all(jnp.stack(equal)), jnp.max(jnp.stack(diff))


def compare(a, b) -> dict:
    """{'bitwise_equal', 'max_abs_diff'} of two pytrees of arrays of the same structure."""
    equal, diff = _differences(jax.tree.leaves(a), jax.tree.leaves(b))
    return {"bitwise_equal": bool(equal), "max_abs_diff": float(diff)}


def _time_call(f, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def measure(workload: str, mesh: Mesh, cfg: Config, *, algorithm: str = "auto",
            reduces=None, rounds: int = 10, warmup: int = 3, profile_dir: str | None = None,
            seed: int = 0) -> dict:
    """Build, compile and time the variants of one step on the same inputs.

    `reduces` defaults to the workload's variants (REDUCES; overlap: OVERLAP_VARIANTS). Each
    variant is compiled (its HLO's XLA collectives and jax_gin custom calls counted) and
    called once untimed, then all are warmed up and timed in turns: every round calls each
    variant once, in the order of `reduces`, so that drifts of the machine hit all medians
    alike. Exposed communication of lax and jax_gin = their median step - the median step of
    the workload's compute-only baseline ('none'; overlap: 'compute'). vs_lax = lax's step /
    this step (for an '_alone' variant, lax_alone's). lax_vs_jax_gin compares the workload's
    `checked` part of lax's and jax_gin's outputs, lax_alone_vs_jax_gin_alone that of the
    '_alone' variants. overlap = step of r / max(step of compute, step of r_alone), for r
    in lax and jax_gin. With `profile_dir`, three more steps of each variant run under
    jax.profiler.trace into profile_dir/<reduce> (with a Perfetto trace).
    """
    w = WORKLOADS[workload]
    reduces = w.variants if reduces is None else tuple(reduces)
    n = mesh.shape[w.axis]
    check_config(workload, cfg, n)
    args = w.inputs(mesh, cfg, seed)
    compiled, outputs, variants = {}, {}, {}
    for r in reduces:
        t0 = time.perf_counter()
        compiled[r] = w.step(mesh, cfg, reduce=r, algorithm=algorithm).lower(*args).compile()
        variants[r] = {"reduce": r, "algorithm": algorithm if r.startswith("jax_gin") else None,
                       "compile_s": time.perf_counter() - t0,
                       **count_collectives(compiled[r].as_text())}
        outputs[r] = jax.block_until_ready(compiled[r](*args))
    for _ in range(warmup):
        for r in reduces:
            _time_call(compiled[r], args)
    times = {r: [] for r in reduces}
    for _ in range(rounds):
        for r in reduces:
            times[r].append(_time_call(compiled[r], args) * 1e3)
    for r in reduces:
        variants[r]["times_ms"] = times[r]
        variants[r]["step_ms"] = statistics.median(times[r]) if times[r] else None
    base = variants.get(w.baseline, {}).get("step_ms")
    for r in reduces:
        v = variants[r]
        v["exposed_ms"] = v["step_ms"] - base \
            if base is not None and r in ("lax", "jax_gin", FUSED) else None
        lax_ms = variants.get("lax_alone" if r.endswith("_alone") else "lax", {}).get("step_ms")
        # On one device lax.psum is no operation: a ratio against it says nothing.
        v["vs_lax"] = lax_ms / v["step_ms"] if lax_ms and v["step_ms"] and n > 1 else None
    if profile_dir:
        for r in reduces:
            with jax.profiler.trace(os.path.join(profile_dir, r), create_perfetto_trace=True):
                for _ in range(3):
                    jax.block_until_ready(compiled[r](*args))
    result = {"workload": workload, "axis": w.axis, "nranks": n,
              "platform": mesh.devices.flat[0].platform, "config": dataclasses.asdict(cfg),
              "psums": w.psums(cfg, n), "rounds": rounds, "warmup": warmup, "seed": seed,
              "algorithm": algorithm, "variants": variants, "profile_dir": profile_dir,
              "lax_vs_jax_gin": None, "lax_alone_vs_jax_gin_alone": None,
              "ratio_lax_over_jax_gin": None, "overlap": None}
    for a, b in COMPARED:
        if a in outputs and b in outputs:
            result[f"{a}_vs_{b}"] = compare(w.checked(outputs[a]), w.checked(outputs[b]))
    steps = {r: v["step_ms"] for r, v in variants.items()}
    if all(steps.get(r) for r in ("compute", "lax", "lax_alone", "jax_gin", "jax_gin_alone")):
        result["overlap"] = {   # together / max(compute alone, all-reduce alone)
            r: steps[r] / max(steps["compute"], steps[f"{r}_alone"]) for r in ("lax", "jax_gin")}
        result["overlap"]["target"] = OVERLAP_TARGET
    if "lax" in outputs and "jax_gin" in outputs and n > 1:
        result["ratio_lax_over_jax_gin"] = lax_over_jax_gin(variants["lax"], variants["jax_gin"])
    return result


def lax_over_jax_gin(lax: dict, gin: dict) -> dict:
    """lax's step time over jax_gin's, and their exposed times' ratio where both are above
    the steps' spread (EXPOSED_FLOOR of the step: smaller ones are noise, their ratio anything)."""
    exposed = (lax["exposed_ms"], gin["exposed_ms"])
    floor = EXPOSED_FLOOR * max(lax["step_ms"] or 0, gin["step_ms"] or 0)
    return {"step": lax["step_ms"] / gin["step_ms"] if gin["step_ms"] else None,
            "exposed": exposed[0] / exposed[1]
            if None not in exposed and min(exposed) > floor else None}


# ---------------------------------------------------------------------------------------
# Report


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else _kib(nbytes)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 2**10:g} KiB" if nbytes >= 2**10 else f"{nbytes} B"


def _f(v, spec=".3f", na="-") -> str:
    return na if v is None else format(v, spec)


def metadata(devices, sizes: str) -> dict:
    from ._bench_report import environment
    return {"benchmark": "workload", **environment(devices, devices[0].platform), "sizes": sizes}


# Exposed communication (step - compute only) below this fraction of the step is within the
# spread of the step times, so the report gives no ratio of exposed times there.
EXPOSED_FLOOR = 0.02

COLUMNS = (("reduce", 13), ("algorithm", 9), ("|", 1), ("step(ms)", 10), ("exposed(ms)", 11),
           ("vs_lax", 7), ("|", 1), ("all-reduce", 10), ("jax_gin_calls", 13), ("compile(s)", 10))


def columns(xla_ops=("all_reduce",)) -> tuple:
    """COLUMNS with one column per XLA collective counted (a workload's xla_ops)."""
    i = [name for name, _ in COLUMNS].index("all-reduce")
    ops = tuple((op.replace("_", "-"), max(10, len(op))) for op in xla_ops)
    return COLUMNS[:i] + ops + COLUMNS[i + 1:]


def _why_different(variant: str, platform: str | None, dtype: str | None,
                   algorithm: str | None = None, xla_ops=("all_reduce",)) -> str | None:
    """Why `variant`'s results can differ from lax's in their last bits, where that is known:
    `algorithm` is jax_gin's, `xla_ops` lax's collectives in the step."""
    fused = ("the fused call computes its rsqrt and its sum of squares its own way, so its "
             "float32 normed can differ from the jnp composition's by a few ulp and round to a "
             "neighbouring value of its dtype: docs/design.md")
    if variant not in ("jax_gin", FUSED) or platform is None:
        return fused if variant == FUSED else None
    if (variant == "jax_gin" and algorithm in ("ring", "tree")
            and dtype in ("bfloat16", "float16")):
        return (f"{algorithm} passes {dtype} partial sums between ranks, each hop rounding "
                "once, where lax's sum rounds once: docs/api.md, Numbers")
    if platform == "cpu" and dtype == "bfloat16":
        # tp-decode's fused variant too: with --xla_allow_excess_precision=false it gave lax's
        # bits on 8 CPU devices, where this note's rounding made up to 0.016 of difference
        ops = " and ".join(op.replace("_", "-") for op in xla_ops)
        return (f"XLA's CPU backend computes lax's bfloat16 {ops} and the ops around it in "
                "float32, dropping roundings the program asks for, which jax_gin's keep; "
                "XLA_FLAGS=--xla_allow_excess_precision=false keeps them in both")
    if variant == FUSED:
        return fused
    if platform == "cpu":
        return None
    return ("each variant is its own XLA program, whose matmul fusions XLA autotunes on its "
            "own: the configurations chosen, and so the last bits of a step, can differ; "
            "--xla_gpu_autotune_level=0 takes the default ones: docs/performance.md")


def format_report(result: dict, meta: dict | None = None) -> list:
    """nccl-tests-like text: '#' header lines, one row per variant, '#' footer lines."""
    cfg = result["config"]
    lines = []
    if meta is not None:
        lines += [
            f"# jax_gin {meta['jax_gin']} workload benchmark: {result['workload']} "
            f"(CUDA extension: {'yes' if meta['jax_gin_cuda'] else 'no'})",
            f"# jax {meta['jax']}  jaxlib {meta['jaxlib']}  python {meta['python']}  "
            f"host {meta['host']}",
            f"# platform {meta['platform']}: {meta['ndevices']} x {meta['device_kind']} "
            f"(of {meta['ndevices_total']} devices)",
            f"# XLA_FLAGS: {meta['xla_flags'] or '(none)'}",
            f"# NCCL_NVLS_ENABLE: {meta['nccl_nvls_enable']}",
            f"# date {meta['date']}",
            f"# sizes: {meta['sizes']}"]
    if result["workload"] == "overlap":
        sizes = f"layers {cfg['layers']}  d_model {cfg['d_model']}  rows {cfg['rows']}  " \
                f"mib {cfg['mib']:g}"
    else:
        sizes = f"layers {cfg['layers']}  d_model {cfg['d_model']}  heads {cfg['heads']}  " \
                f"ffn {cfg['ffn']}  seq {cfg['seq']}  batch {cfg['batch']}" \
                + (f"  vocab {cfg['vocab']}" if cfg["vocab"] else "")
    w = WORKLOADS[result["workload"]]
    baseline, cols = w.baseline, columns(w.xla_ops)
    lines += [
        f"# {result['workload']} on mesh axis '{result['axis']}' of {result['nranks']}: "
        f"{sizes}  {cfg['dtype']}",
        f"# per step: {result['psums']['text']}",
        f"# {result['rounds']} rounds of the variants in turns after {result['warmup']} warm-up; "
        "step = median wall time of one jit call",
        "#",
        "#" + " ".join(name.rjust(width) for name, width in cols)[1:]]
    for r, v in result["variants"].items():
        cells = [r, v["algorithm"] or "-", "|", _f(v["step_ms"]), _f(v["exposed_ms"]),
                 _f(v["vs_lax"], ".2f"), "|", *(str(v[op]) for op in w.xla_ops),
                 str(v["jax_gin_calls"]), _f(v["compile_s"], ".1f")]
        lines.append(" ".join(c.rjust(width) for c, (_, width) in zip(cells, cols)))
    lines.append("#")
    # the vs_lax legend only where a lax variant ran (a run of one variant has no ratio)
    vs_lax = any(v["vs_lax"] is not None for v in result["variants"].values())
    if result["workload"] == "fsdp":
        legend = ("# exposed = step - compute-only ('none': local copies for the all-gathers, "
                  "a local slice for the reduce-scatters)", "; vs_lax = lax step / this step")
    elif baseline == "none":
        legend = ("# exposed = step - compute-only ('none', the all-reduce replaced by the "
                  "identity)", "; vs_lax = lax step / this step")
    else:
        legend = (f"# exposed = step - compute-only ('{baseline}')",
                  "; vs_lax = lax step / this step (_alone: lax_alone step / this step)")
    lines.append(legend[0] + (legend[1] if vs_lax else ""))
    if result["nranks"] == 1:
        lines.append("# one device: lax.psum is no operation and jax_gin's auto returns its "
                     "input (an explicit algorithm copies it), so no lax ratio is given")
    to_xla = [r for r, v in result["variants"].items() if v["algorithm"] == "auto"
              and v["jax_gin_calls"] == 0 and any(v[op] for op in w.xla_ops)]
    if to_xla:
        ops = " and ".join(op.replace("_", "-") for op in w.xla_ops)
        lines.append(f"# {', '.join(to_xla)}: no jax_gin call; auto chose XLA's {ops} for every "
                     f"size in {'that program' if len(to_xla) == 1 else 'those programs'}")
    overlap = result.get("overlap")
    if overlap:
        lines.append(f"# overlap = together / max(compute alone, all-reduce alone): "
                     f"lax {overlap['lax']:.3f}, jax_gin {overlap['jax_gin']:.3f} "
                     f"(target <= {overlap['target']:g})")
    ratio = result["ratio_lax_over_jax_gin"]
    if ratio:
        same = ("; the jax_gin program made no jax_gin call, so both are XLA's and the ratio "
                "is their run-to-run spread" if "jax_gin" in to_xla else "")
        lines.append(f"# lax / jax_gin: step {_f(ratio['step'], '.3f')}, "
                     f"exposed communication {_f(ratio['exposed'], '.3f')}{same}")
    for a, b in COMPARED:
        cmp = result.get(f"{a}_vs_{b}")
        if not cmp:
            continue
        same = "yes" if cmp["bitwise_equal"] else "no"
        lines.append(f"# {a} vs {b} results: bitwise equal {same}, "
                     f"max abs diff {cmp['max_abs_diff']:.3g}")
        why = None if cmp["bitwise_equal"] else \
            _why_different(b, result.get("platform"), cfg.get("dtype"),
                           result.get("algorithm"), w.xla_ops)
        if why:
            lines.append(f"#   ({why})")
    if result.get("profile_dir"):
        lines.append(f"# profiles: {result['profile_dir']}/<reduce>")
    return lines


# ---------------------------------------------------------------------------------------
# Command line


def build_parser(prog: str = "python -m jax_gin.workloads") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Time a whole step with lax.psum, jax_gin.psum and no all-reduce "
                    "(compute only), in turns; tp-decode also with jax_gin.psum_add_rmsnorm; "
                    "fsdp: lax's or jax_gin's all_gather and psum_scatter, or local copies; "
                    "overlap: matmuls alone, all-reduce alone (lax's or jax_gin's), and both in "
                    "one step. Sizes default to the GPU sizes on GPUs and to tiny ones on CPU "
                    "devices.")
    p.add_argument("--workload", choices=NAMES, required=True, help="the step to time")
    p.add_argument("--layers", type=int, help="blocks; overlap: matmuls in the chain")
    p.add_argument("--d-model", type=int,
                   help="the model width; overlap: the matmuls' inner and outer size")
    p.add_argument("--heads", type=int, help="attention heads (default: head size of the defaults)")
    p.add_argument("--ffn", type=int, help="MLP hidden size (default: the defaults' ratio)")
    p.add_argument("--seq", type=int, help="sequence length; tp-decode: cached context length")
    p.add_argument("--batch", "--tokens", type=int, dest="batch",
                   help="sequences (dp-train, fsdp: per device); tp-decode: tokens decoded")
    p.add_argument("--vocab", type=int, help="dp-train's and fsdp's vocabulary")
    p.add_argument("--rows", type=int, help="overlap: rows of the matmuls per device "
                   "(default 4096 on GPU)")
    p.add_argument("--mib", type=float, help="overlap: MiB all-reduced per device "
                   "(default 256 on GPU)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--algorithm", default="auto", choices=("auto",) + tuple(jax_gin.ALGORITHMS),
                   help="jax_gin's algorithm (default auto; fsdp: auto, "
                        f"{', '.join(COLLECTIVE_ALGORITHMS)})")
    p.add_argument("--overlap", action="store_true",
                   help="the jax_gin variants call psum(..., overlap=True): asynchronous, few "
                        "lanes; in the overlap workload, jax_gin runs psum_overlapping beside "
                        "the matmul chain (not fsdp, whose step has no psum)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds of the variants in turns (default 20 on GPU, 10 on CPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds (default 3)")
    p.add_argument("--devices", type=int, default=None, help="use the first N devices")
    p.add_argument("--json", metavar="PATH", help="write every number as JSON")
    p.add_argument("--profile", metavar="DIR", help="jax.profiler traces of 3 steps per variant")
    return p


def main(argv=None, prog: str = "python -m jax_gin.workloads") -> int:
    """Run one workload; returns 0 (the results are reported, not judged). `prog`: the
    command that runs it (python -m jax_gin.bench --workload passes its own)."""
    _runtime.refuse_invalid_variables(prog)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if (args.rounds is not None and args.rounds < 1) or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices {args.devices}: must be at least 1")
    ignored = [f"--{name.replace('_', '-')}" for name in SIZE_OPTIONS
               if getattr(args, name) is not None and name not in reads(args.workload)]
    if ignored:
        parser.error(f"{', '.join(ignored)}: not read by --workload {args.workload}, which "
                     f"reads {', '.join('--' + n.replace('_', '-') for n in reads(args.workload))}")
    if args.json is not None:
        try:  # before the run that would fill it
            _check_writable(args.json, "--json")
        except OSError as err:
            parser.error(str(err))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (docs/multi-node.md)
    devices = jax.devices()
    if args.devices is not None:
        if not 1 <= args.devices <= len(devices):  # a usage error, known only now
            parser.error(f"--devices {args.devices}: between 1 and {len(devices)} devices "
                         "are available")
        devices = devices[:args.devices]
    platform = "cpu" if devices[0].platform == "cpu" else "gpu"
    given = {name: getattr(args, name) for name in SIZE_OPTIONS}
    changed = [f"{k}={v}" for k, v in given.items() if v is not None]
    sizes = ("GPU defaults" if platform == "gpu" else "CPU defaults (tiny)") + \
        (f", changed: {' '.join(changed)}" if changed else "") + \
        ("" if not args.overlap else ", jax_gin as psum_overlapping beside the matmuls"
         if args.workload == "overlap" else ", jax_gin with overlap=True")
    rounds = args.rounds if args.rounds is not None else (10 if platform == "cpu" else 20)
    mesh = make_mesh(args.workload, devices)
    try:
        cfg = dataclasses.replace(default_config(args.workload, platform, **given),
                                  overlap=args.overlap)
        check_config(args.workload, cfg, len(devices))
    except ValueError as e:
        raise SystemExit(f"{args.workload}: {e}")
    try:
        check_dtype(args.workload, cfg.dtype, devices[0].platform)
    except ValueError as e:  # a usage error, as argparse's (status 2), in one line
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.algorithm not in ("auto",) + WORKLOADS[args.workload].algorithms:
        raise SystemExit(f"{args.workload}: --algorithm {args.algorithm}: its collectives take "
                         f"auto, {', '.join(WORKLOADS[args.workload].algorithms)}")
    result = measure(args.workload, mesh, cfg, algorithm=args.algorithm, rounds=rounds,
                     warmup=args.warmup, profile_dir=args.profile)
    meta = metadata(devices, sizes)
    for line in format_report(result, meta):
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, **result}, fh, indent=1)
            fh.write("\n")
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
