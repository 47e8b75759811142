"""``core.layout.ReplicaLayout``: which worker is which coordinate (stage, shard, tensor) of which replica."""

from __future__ import annotations

import itertools
import math

import pytest

from unbroken.core.config import ParallelConfig
from unbroken.core.layout import ReplicaLayout

pytestmark = pytest.mark.timeout(30)

DEGREES = [1, 2, 3]


@pytest.mark.parametrize(("shard", "pipeline", "tensor"), list(itertools.product(DEGREES, DEGREES, DEGREES)))
def test_every_rank_of_a_replica_is_one_coordinate_of_its_mesh_tensor_innermost(
    shard: int, pipeline: int, tensor: int
) -> None:
    layout = ReplicaLayout(shard, pipeline, tensor)
    replicas = 3
    seen = set()
    for worker in range(replicas * layout.size):
        replica, rank = layout.replica_of(worker), layout.rank_of(worker)
        coordinate = (layout.stage_of(worker), layout.shard_of(worker), layout.tensor_of(worker))
        assert worker in layout.workers_of(replica)
        # row-major over (pipeline, shard, tensor): the mesh init_device_mesh builds from ReplicaLayout.dims
        assert rank == (coordinate[0] * shard + coordinate[1]) * tensor + coordinate[2]
        seen.add((replica, coordinate))
        # the FT group of this rank index: the same coordinate in every replica, one worker each
        assert [layout.replica_of(w) for w in layout.coordinate(range(replicas * layout.size), rank)] == [0, 1, 2]
    assert len(seen) == replicas * layout.size  # a bijection
    expected = [(name, n) for name, n in (("pp", pipeline), ("shard", shard), ("tensor", tensor)) if n > 1]
    assert list(layout.dims) == (expected or [("shard", 1)])
    assert math.prod(n for _, n in layout.dims) == layout.size


def test_the_layout_of_a_config_and_a_count_of_workers_that_is_not_whole_replicas() -> None:
    layout = ReplicaLayout.of(ParallelConfig(shard=2, pipeline=1, tensor=2))
    assert layout == ReplicaLayout(2, 1, 2) and layout.replicas_in(8) == 2
    with pytest.raises(ValueError, match=r"--workers = 6 is not a whole number of replicas of 4 ranks"):
        layout.replicas_in(6)
    with pytest.raises(ValueError, match="must be >= 1"):
        ReplicaLayout(1, 1, 0)


def test_a_death_takes_its_whole_replica_and_only_whole_replicas_are_alive() -> None:
    layout = ReplicaLayout(shard=1, pipeline=2, tensor=2)  # replicas of 4
    assert layout.with_replicas([5]) == (4, 5, 6, 7)
    assert layout.whole([0, 1, 2, 3, 4, 6, 7]) == (0, 1, 2, 3)
    assert layout.replicas([3, 4, 9]) == (0, 1, 2)
