"""Unit tests of the shared schedule header, and the algorithms run by N host threads for
group sizes that no JAX mesh here has."""
import numpy as np
import pytest

import jax_gin
from jax_gin import _native
from jax_gin._ops import ALGORITHM_CODES, OP_CODES
from helpers import assert_bitwise

S = _native.cpu.schedule


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 1000, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_pieces_cover_exactly_and_align(n, parts):
    align = 4
    covered = []
    for j in range(parts):
        off, cnt = S.piece(n, parts, j, align)
        assert off % align == 0 or cnt == 0
        covered.extend(range(off, off + cnt))
    assert covered == list(range(n))


@pytest.mark.parametrize("n", range(2, 10))
def test_ring_schedule(n):
    for r in range(n):
        assert S.ring_prev(S.ring_next(r, n), n) == r
        for s in range(n - 1):
            # what I receive at step s is what my predecessor sends at step s
            assert S.ring_rs_recv(r, s, n) == S.ring_rs_send(S.ring_prev(r, n), s, n)
            assert S.ring_ag_recv(r, s, n) == S.ring_ag_send(S.ring_prev(r, n), s, n)
            # and I send it on at the next step
            if s + 1 < n - 1:
                assert S.ring_rs_send(r, s + 1, n) == S.ring_rs_recv(r, s, n)
        assert S.ring_ag_send(r, 0, n) == S.ring_owned(r, n)
        got = {S.ring_owned(r, n)} | {S.ring_ag_recv(r, s, n) for s in range(n - 1)}
        assert got == set(range(n))  # all-gather delivers every segment
    assert sorted(S.ring_owned(r, n) for r in range(n)) == list(range(n))


@pytest.mark.parametrize("n", range(1, 12))
@pytest.mark.parametrize("t", [0, 1])
def test_tree_schedule(n, t):
    root = 0 if t == 0 else n - 1
    assert S.tree_parent(root, n, t) == -1
    for r in range(n):
        if r == root:
            continue
        p = S.tree_parent(r, n, t)
        assert 0 <= p < n and p != r
        assert S.tree_child(p, S.tree_child_index(r, n, t), n, t) == r
        # every rank reaches the root
        seen = 0
        while r != root:
            r = S.tree_parent(r, n, t)
            seen += 1
            assert seen <= n
    # children are distinct and point back
    kids = [c for r in range(n) for k in (0, 1) if (c := S.tree_child(r, k, n, t)) >= 0]
    assert sorted(kids) == sorted(set(range(n)) - {root})


@pytest.mark.parametrize("n", [2, 4, 6, 8, 16])
def test_double_tree_interiors_are_disjoint(n):
    """For even N every rank forwards (has children) in at most one of the two trees."""
    def interior(t):
        return {r for r in range(n) if S.tree_child(r, 0, n, t) >= 0}
    assert not interior(0) & interior(1)
    assert len(interior(0)) == len(interior(1)) == n // 2


@pytest.mark.parametrize("n", [0, 1, 4, 17, 1000, 4099])
def test_tree_halves_and_chunks_cover(n):
    align = 4
    covered = []
    for t in (0, 1):
        off, cnt = S.tree_half(n, t, align)
        chunks = S.chunks_for(S.piece(n, 2, 0, align)[1], 4, 64)
        assert 1 <= chunks <= S.MAX_CHUNKS
        for c in range(chunks):
            o, k = S.chunk(off, cnt, chunks, c, align)
            assert o % align == 0 or k == 0
            covered.extend(range(o, o + k))
    assert covered == list(range(n))


def test_chunks_for():
    assert S.chunks_for(0, 4, 1024) == 1
    assert S.chunks_for(256, 4, 1024) == 1
    assert S.chunks_for(257, 4, 1024) == 2
    assert S.chunks_for(1 << 30, 4, 1024) == S.MAX_CHUNKS
    assert S.chunks_for(1 << 20, 4, 0) == 1  # 0: no pipelining


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_capacity_fits_window(algo, n):
    lane = 1 << 16
    a = ALGORITHM_CODES[algo]
    slot = S.slot_elems(a, n, lane, 4)
    assert slot % 4 == 0 and slot > 0
    assert slot * S.num_slots(a, n) * 4 <= lane
    cap = S.round_capacity(a, n, lane, 4)
    assert cap == (slot * n if algo in ("ring", "two_shot") else slot)


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16])
@pytest.mark.parametrize("count", [1, 3, 64, 1001])
def test_threads_allreduce(algo, n, count):
    rng = np.random.default_rng(n * 1000 + count)
    x = rng.integers(-9, 10, size=(n, count)).astype(np.float32)
    # a small window forces many rounds, i.e. the chunking and the credit protocol
    out = _native.cpu.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES[algo],
                                        256 * max(n, 2), repeats=3)
    assert_bitwise(out, np.broadcast_to(x.sum(0), x.shape))
    for op, ref in (("max", x.max(0)), ("min", x.min(0))):
        out = _native.cpu.threads_allreduce(x, OP_CODES[op], ALGORITHM_CODES[algo], 4096)
        assert_bitwise(out, np.broadcast_to(ref, x.shape))


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("chunk_bytes", [0, 16, 48, 1 << 20])
def test_threads_pipelined_chunks(algo, n, chunk_bytes):
    """Pipelining cuts each step into chunks signalled one by one (16 B: as many chunks as
    allowed, with empty ones; 0 and 1 MiB: one chunk). Same bits in every case."""
    rng = np.random.default_rng(n)
    x = rng.integers(-9, 10, size=(n, 4099)).astype(np.float32)
    for lane in (1 << 14, 1 << 20):  # several rounds, and one
        out = _native.cpu.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES[algo], lane,
                                            repeats=2, chunk_bytes=chunk_bytes)
        assert_bitwise(out, np.broadcast_to(x.sum(0), x.shape))


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.uint32])
def test_threads_dtypes(dtype):
    x = (np.arange(5 * 77).reshape(5, 77) % 11).astype(dtype)
    for algo in ALGORITHM_CODES.values():
        out = _native.cpu.threads_allreduce(x, OP_CODES["sum"], algo, 1024)
        assert_bitwise(out, np.broadcast_to(x.sum(0, dtype=x.dtype), x.shape))


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_threads_same_bits_on_every_rank(algo, n):
    """Inexact float sums: whatever order an algorithm reduces in, every rank must end with
    the same bits (the value is computed once and copied), and each element stays within
    float32 rounding of the exact sum."""
    rng = np.random.default_rng(7 * n)
    x = rng.standard_normal((n, 30001)).astype(np.float32)
    out = _native.cpu.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES[algo], 1 << 14,
                                        repeats=2, chunk_bytes=64)
    for r in range(1, n):
        np.testing.assert_array_equal(out[r].view(np.uint32), out[0].view(np.uint32))
    np.testing.assert_allclose(out[0], x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
