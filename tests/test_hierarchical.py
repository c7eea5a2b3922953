"""The hierarchical schedule (internal algorithm, include/jax_gin/schedule.h and algorithms.h)
on the CPU backend, with ranks node*L .. node*L+L-1 of one group playing the ranks of a node:
unit tests of its schedule functions, a model of one round built from them, and the algorithm
run by host threads through threads_allreduce."""
from collections import Counter, defaultdict

import numpy as np
import pytest

import jax_gin
from jax_gin import _native, _runtime, _select
from jax_gin._ops import ALGORITHM_CODES, OP_CODES
from helpers import assert_bitwise

C = _native.cpu
S = C.schedule
H = C.ALGORITHM_HIERARCHICAL
SHAPES = [(1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (3, 1), (5, 1)]  # (nodes, L)
ALL_SHAPES = SHAPES + [(1, 5), (3, 3), (4, 4), (2, 8), (8, 2)]


def test_internal_only():
    # not a public algorithm: no name in ALGORITHMS, a code of none of theirs, and refused by
    # name; _runtime's own copy of the code (what it passes for groups that span nodes) is
    # the native one
    assert "hierarchical" not in jax_gin.ALGORITHMS
    assert H not in ALGORITHM_CODES.values()
    with pytest.raises(ValueError, match="unknown algorithm 'hierarchical'"):
        _select.validate("hierarchical", "psum")
    assert _runtime.HIERARCHICAL_CODE == H


@pytest.mark.parametrize("M,L", ALL_SHAPES)
def test_decomposition(M, L):
    n = M * L
    assert S.hier_valid(n, L) and S.hier_local_size(n, L) == L and S.hier_nodes(n, L) == M
    for r in range(n):
        m, l = S.hier_node(r, L), S.hier_local(r, L)
        assert 0 <= m < M and 0 <= l < L and S.hier_rank(m, l, L) == r
        nxt, prv = S.hier_rail_next(r, L, M), S.hier_rail_prev(r, L, M)
        assert S.hier_local(nxt, L) == l and S.hier_node(nxt, L) == (m + 1) % M
        assert S.hier_rail_prev(nxt, L, M) == r and S.hier_rail_next(prv, L, M) == r


def test_ranks_per_node_values():
    assert S.hier_local_size(6, 0) == 6  # 0: one node
    assert S.hier_valid(6, 0) and S.hier_valid(6, 6) and S.hier_valid(6, 1)
    assert not S.hier_valid(6, 4) and not S.hier_valid(6, -1) and not S.hier_valid(6, 7)


@pytest.mark.parametrize("M,L", ALL_SHAPES)
@pytest.mark.parametrize("n", [0, 1, 3, 16, 64, 1001, 4099])
def test_segments_and_subpieces_partition(M, L, n):
    align = 4
    covered = []
    for l in range(L):
        off, cnt = S.hier_segment(n, L, l, align)
        assert off % align == 0 or cnt == 0
        sub = []
        for j in range(M):
            so, sc = S.hier_subpiece(n, L, M, l, j, align)
            assert so % align == 0 or sc == 0
            sub.extend(range(so, so + sc))
        assert sub == list(range(off, off + cnt))  # sub-pieces partition the segment
        covered.extend(sub)
    assert covered == list(range(n))  # segments (and so all sub-pieces) partition the round


def simulate_round(M, L, n, slot, align=4):
    """One round, built from the schedule functions only (the same calls, in the same order, as
    hierarchical_round). Values are Counters of contributing ranks. Returns the outputs, the
    ranks that computed each element's final value, and the puts as
    (sender, receiver, step, window offset, count)."""
    N = M * L
    inp = [[Counter({r: 1}) for _ in range(n)] for r in range(N)]
    out = [[None] * n for _ in range(N)]
    win = [dict() for _ in range(N)]  # receiver window: offset -> list of values
    puts = []
    final_at = defaultdict(list)
    ring0 = S.hier_segment_slots(L) * slot
    rslot = S.hier_ring_slot_elems(slot, M, align)

    def put(src_rank, dst, step, woff, vals):
        puts.append((src_rank, dst, step, woff, len(vals)))
        win[dst][woff] = [Counter(v) for v in vals]

    def reduce(r, idx, *vals):
        v = sum(vals, Counter())
        if len(v) == N:
            final_at[idx].append(r)
        return v

    mine = {r: S.hier_segment(n, L, S.hier_local(r, L), align) for r in range(N)}
    # 1. intra-node reduce-scatter
    if L > 1:
        for r in range(N):
            m, l = S.hier_node(r, L), S.hier_local(r, L)
            for k in range(1, L):
                q = (l + k) % L
                off, cnt = S.hier_segment(n, L, q, align)
                assert cnt <= slot
                put(r, S.hier_rank(m, q, L), S.HIER_SCATTER_STEP, S.hier_scatter_slot(l) * slot,
                    inp[r][off:off + cnt])
        for r in range(N):
            m, l = S.hier_node(r, L), S.hier_local(r, L)
            off, cnt = mine[r]
            for i in range(cnt):
                srcs = [inp[r][off + i] if q == l else win[r][S.hier_scatter_slot(q) * slot][i]
                        for q in range(L)]
                out[r][off + i] = reduce(r, off + i, *srcs)
    # 2. ring over each rail on the owned segment (all ranks step by step, in lockstep)
    if M > 1:
        rin = {r: (out[r] if L > 1 else inp[r]) for r in range(N)}
        part = {r: list(rin[r]) for r in range(N)}  # the node's partial of the whole round
        for s in range(2 * (M - 1)):
            step = S.hier_ring_step(s)
            sent = {}
            for r in range(N):
                node, (off, cnt) = S.hier_node(r, L), mine[r]
                j = S.ring_rs_send(node, s, M) if s < M - 1 else \
                    S.ring_ag_send(node, s - (M - 1), M)
                so, sc = S.piece(cnt, M, j, align)
                assert sc <= rslot
                src = part[r] if s == 0 else out[r]
                sent[r] = (S.hier_rail_next(r, L, M), step, ring0 + s * rslot,
                           src[off + so:off + so + sc])
            for r, (dst, st, woff, vals) in sent.items():
                put(r, dst, st, woff, vals)
            for r in range(N):
                node, (off, cnt) = S.hier_node(r, L), mine[r]
                j = S.ring_rs_recv(node, s, M) if s < M - 1 else \
                    S.ring_ag_recv(node, s - (M - 1), M)
                so, sc = S.piece(cnt, M, j, align)
                got = win[r][ring0 + s * rslot]
                for i in range(sc):
                    if s < M - 1:
                        out[r][off + so + i] = reduce(r, off + so + i, got[i], part[r][off + so + i])
                    else:
                        out[r][off + so + i] = Counter(got[i])
    # 3. intra-node all-gather
    if L > 1:
        step = S.hier_gather_step(M)
        for r in range(N):
            m, l = S.hier_node(r, L), S.hier_local(r, L)
            off, cnt = mine[r]
            for k in range(1, L):
                put(r, S.hier_rank(m, (l + k) % L, L), step, S.hier_gather_slot(l, L) * slot,
                    out[r][off:off + cnt])
        for r in range(N):
            m, l = S.hier_node(r, L), S.hier_local(r, L)
            for k in range(1, L):
                q = (l + k) % L
                off, cnt = S.hier_segment(n, L, q, align)
                for i in range(cnt):
                    out[r][off + i] = Counter(win[r][S.hier_gather_slot(q, L) * slot][i])
    return out, final_at, puts


@pytest.mark.parametrize("M,L", ALL_SHAPES)
@pytest.mark.parametrize("n", [1, 3, 29, 64])
def test_model_round(M, L, n):
    N = M * L
    slot = S.hier_segment(n, L, 0, 4)[1]  # the largest segment
    slot = max(4, (slot + 3) // 4 * 4)
    out, final_at, puts = simulate_round(M, L, n, slot)
    everyone = Counter({r: 1 for r in range(N)})
    for r in range(N):
        assert out[r] == [everyone] * n  # every element: every rank's input exactly once
    for i in range(n):
        # each element's final value is computed by exactly one rank, then only copied
        assert len(final_at[i]) == 1, (i, final_at[i])
    steps = defaultdict(list)
    slots_used = defaultdict(set)
    ring0 = S.hier_segment_slots(L) * slot
    for src, dst, step, woff, cnt in puts:
        assert src != dst
        same_node = S.hier_node(src, L) == S.hier_node(dst, L)
        # intra-node steps go to local peers, ring steps along the rail to the next node
        if step in (S.HIER_SCATTER_STEP, S.hier_gather_step(M)) and L > 1:
            assert same_node and woff < ring0
        else:
            assert S.hier_rail_next(src, L, M) == dst and woff >= ring0
        assert 0 <= step < S.hier_steps(M)
        steps[(src, dst)].append(step)
        # no window region is written twice in one round, and all fits the window
        assert woff not in slots_used[dst]
        slots_used[dst].add(woff)
        assert woff + cnt <= S.hier_window_elems(slot, L, M, 4)
    for seq in steps.values():
        assert seq == sorted(set(seq))  # data tags of a pair strictly increase


@pytest.mark.parametrize("M,L", ALL_SHAPES)
def test_slot_fit(M, L):
    N = M * L
    for w in list(range(0, 400, 7)) + [1 << 14, (1 << 18) // 4 + 12]:
        s = S.hier_slot_fit(w, L, M, 4)
        assert s % 4 == 0
        assert S.hier_window_elems(s, L, M, 4) <= w
        # and it is the largest aligned slot that fits
        for bigger in range(s + 4, min(w, s + 64) + 1, 4):
            assert S.hier_window_elems(bigger, L, M, 4) > w


@pytest.mark.parametrize("M,L", ALL_SHAPES)
def test_capacity(M, L):
    N = M * L
    lane = 1 << 16
    for rpn in ([L, 0] if M == 1 else [L]):
        slot = S.slot_elems(H, N, lane, 4, ranks_per_node=rpn)
        assert slot % 4 == 0 and (slot > 0 or N == 1)
        assert S.hier_window_elems(slot, L, M, 4) * 4 <= lane
        assert S.round_capacity(H, N, lane, 4, ranks_per_node=rpn) == slot * L
        assert S.num_slots(H, N, ranks_per_node=rpn) == max(
            1, S.hier_segment_slots(L) + S.hier_ring_slots(M))
    # public algorithms ignore ranks_per_node
    for a in ALGORITHM_CODES.values():
        assert S.slot_elems(a, N, lane, 4, ranks_per_node=L) == S.slot_elems(a, N, lane, 4)


def reference_in_order(x, M, L, op, cap):
    """The result in the schedule's reduction order: local ranks left to right within each
    node, then, for sub-piece j of a segment of a round (rounds of `cap` elements), nodes j,
    j+1, ..., j-1 (ring order)."""
    N, count = x.shape
    part = np.empty((M, count), x.dtype)
    for m in range(M):
        acc = x[m * L].copy()
        for l in range(1, L):
            acc = op(acc, x[m * L + l])
        part[m] = acc
    res = np.empty(count, x.dtype)
    for base in range(0, count, cap):
        n = min(cap, count - base)
        for l in range(L):
            for j in range(M):
                off, cnt = S.hier_subpiece(n, L, M, l, j, 16 // x.itemsize)
                sl = slice(base + off, base + off + cnt)
                acc = part[j % M, sl].copy()
                for k in range(1, M):
                    acc = op(acc, part[(j + k) % M, sl])
                res[sl] = acc
    return res


REFS = {"sum": lambda x: x.sum(0, dtype=x.dtype), "max": lambda x: x.max(0),
        "min": lambda x: x.min(0)}


@pytest.mark.parametrize("M,L", SHAPES)
@pytest.mark.parametrize("count", [1, 3, 64, 1001])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("op", list(OP_CODES))
def test_threads_hierarchical(M, L, count, dtype, op):
    N = M * L
    rng = np.random.default_rng(N * 1000 + count + 7 * OP_CODES[op])
    x = rng.integers(-9, 10, size=(N, count)).astype(dtype)
    # a small window forces many rounds, i.e. the chunking and the credit protocol
    out = C.threads_allreduce(x, OP_CODES[op], H, 256 * max(N, 2), repeats=3, ranks_per_node=L)
    assert out.dtype == x.dtype
    assert_bitwise(out, np.broadcast_to(REFS[op](x), x.shape))
    # a roomy window: one round
    out = C.threads_allreduce(x, OP_CODES[op], H, 1 << 16, ranks_per_node=L)
    assert_bitwise(out, np.broadcast_to(REFS[op](x), x.shape))


@pytest.mark.parametrize("M,L", SHAPES + [(4, 4), (8, 2), (2, 8)])
@pytest.mark.parametrize("count", [5, 3001])
def test_threads_hierarchical_bitwise(M, L, count):
    # Non-integer floats: the sum depends on the order. Every rank must hold the same bits,
    # the ones of the documented order.
    N = M * L
    x = np.random.default_rng(count + N).standard_normal((N, count)).astype(np.float32)
    for lane in (512 * N, 1 << 16):
        out = C.threads_allreduce(x, OP_CODES["sum"], H, lane, repeats=2, ranks_per_node=L)
        cap = S.round_capacity(H, N, lane, 4, ranks_per_node=L)
        assert lane > 1 << 15 or count < 100 or cap < count  # small window: several rounds
        want = reference_in_order(x, M, L, np.add, cap)
        for r in range(N):
            assert out[r].tobytes() == want.tobytes(), r
        np.testing.assert_allclose(out[0], x.astype(np.float64).sum(0), rtol=1e-4, atol=1e-4)


def test_one_node_defaults():
    x = (np.arange(6 * 50).reshape(6, 50) % 13).astype(np.float32)
    want = np.broadcast_to(x.sum(0), x.shape)
    for rpn in (0, 6):  # 0: all ranks one node
        assert_bitwise(C.threads_allreduce(x, OP_CODES["sum"], H, 1024, ranks_per_node=rpn), want)
    # the public algorithms ignore ranks_per_node
    for algo in ALGORITHM_CODES.values():
        assert_bitwise(C.threads_allreduce(x, OP_CODES["sum"], algo, 1024, ranks_per_node=3), want)


@pytest.mark.parametrize("rpn", [4, -1, 7])
def test_bad_ranks_per_node(rpn):
    x = np.zeros((6, 8), np.float32)
    with pytest.raises(ValueError, match="ranks_per_node"):
        C.threads_allreduce(x, OP_CODES["sum"], H, 1024, ranks_per_node=rpn)


def test_bad_algorithm_id():
    with pytest.raises(ValueError, match="algorithm"):
        C.threads_allreduce(np.zeros((2, 8), np.float32), OP_CODES["sum"], H + 1, 1024)


def test_timeout_names_hierarchical():
    # rank 3's signals are dropped: its peers time out with a message that names the algorithm
    x = np.ones((4, 64), np.float32)
    with pytest.raises(RuntimeError, match=r"\(hierarchical\).*step"):
        C.threads_allreduce(x, OP_CODES["sum"], H, 4096, timeout_s=0.3, fault_rank=3,
                            ranks_per_node=2)
