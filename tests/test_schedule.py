"""Unit tests of the shared schedule header, and the algorithms run by N host threads for
group sizes that no JAX mesh here has."""
import numpy as np
import pytest

import jax_gin
from jax_gin import _native

S = _native.cpu.schedule
ALGOS = {name: i for i, name in enumerate(jax_gin.ALGORITHMS)}


def test_algorithm_names_match_native():
    assert tuple(_native.cpu.algorithm_names()) == jax_gin.ALGORITHMS


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
def test_tree_schedule(n):
    for r in range(1, n):
        p = S.tree_parent(r)
        assert 0 <= p < r
        assert S.tree_child(p, S.tree_child_index(r), n) == r
    assert S.tree_parent(0) == -1
    # every rank reaches the root
    for r in range(n):
        seen = 0
        while r != 0:
            r = S.tree_parent(r)
            seen += 1
            assert seen <= n


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_capacity_fits_window(algo, n):
    lane = 1 << 16
    a = ALGOS[algo]
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
    out = _native.cpu.threads_allreduce(x, 0, ALGOS[algo], 256 * max(n, 2), repeats=3)
    np.testing.assert_array_equal(out, np.broadcast_to(x.sum(0), x.shape))
    for op, ref in ((1, x.max(0)), (2, x.min(0))):
        out = _native.cpu.threads_allreduce(x, op, ALGOS[algo], 4096)
        np.testing.assert_array_equal(out, np.broadcast_to(ref, x.shape))


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.uint32])
def test_threads_dtypes(dtype):
    x = (np.arange(5 * 77).reshape(5, 77) % 11).astype(dtype)
    for algo in ALGOS.values():
        out = _native.cpu.threads_allreduce(x, 0, algo, 1024)
        np.testing.assert_array_equal(out, np.broadcast_to(x.sum(0), x.shape))
