"""Algorithm choice for GPU groups that span nodes (_runtime.algorithm_code): they run only the
internal hierarchical algorithm, which 'auto' picks, and an explicit algorithm is refused. The
GPU communicator is replaced by a fake that reports its ranks per node; the GIN path itself is
exercised by the native harness (cuda/harness.cu --ranks-per-node) on a GPU."""
import pytest

from jax_gin import _native, _runtime
from jax_gin._ops import ALGORITHM_CODES


class FakeCuda:
    def __init__(self, ranks_per_node):
        self.rpn = ranks_per_node

    def comm_ranks_per_node(self, comm):
        return self.rpn


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(rpn):
        monkeypatch.setattr(_native, "cuda", FakeCuda(rpn))
    return install


def test_cpu_and_one_node_keep_the_choice(fake_cuda):
    fake_cuda(4)
    assert _runtime.algorithm_code("cpu", 1, "ring", "ring", "psum") == ALGORITHM_CODES["ring"]
    fake_cuda(0)
    for name, code in ALGORITHM_CODES.items():
        assert _runtime.algorithm_code("cuda", 1, "auto", name, "psum") == code
        assert _runtime.algorithm_code("cuda", 1, name, name, "psum") == code


def test_spanning_group_auto_runs_hierarchical(fake_cuda):
    fake_cuda(4)
    assert _runtime.algorithm_code("cuda", 1, "auto", "two_shot", "psum") == _runtime.HIERARCHICAL_CODE


@pytest.mark.parametrize("name", sorted(ALGORITHM_CODES))
def test_spanning_group_refuses_explicit_algorithms(fake_cuda, name):
    fake_cuda(8)
    with pytest.raises(ValueError, match=r"algorithm='%s'.*span nodes \(8 ranks per node\).*'auto'" % name):
        _runtime.algorithm_code("cuda", 1, name, name, "pmax")


def test_no_cuda_module(monkeypatch):
    monkeypatch.setattr(_native, "cuda", None)
    assert _runtime.algorithm_code("cuda", 1, "auto", "ring", "psum") == ALGORITHM_CODES["ring"]
