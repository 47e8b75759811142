"""What one rank holds of a parameter: the local part of a ``DTensor`` (FSDP's shard, a tensor-parallel split).

``is_dtensor`` never imports DTensor's module (it costs a worker about a second); ``split_over_tensor_ranks``
tells a tensor split over the replica's tensor ranks from one every tensor rank holds whole.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2's sharded parameters), without importing DTensor's module: it
    costs a worker about a second at start, and where it was never imported no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local part of a ``DTensor`` (FSDP's shard, a tensor-parallel split),
    else the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


TENSOR_DIMS = ("tensor", "tp")  # a replica mesh's tensor-parallel dimension: ours, torchtitan's


def split_over_tensor_ranks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is split over the replica's tensor ranks (a ``DTensor`` sharded on the mesh dimension
    named ``"tensor"``, or ``"tp"`` as torchtitan names it); if not, every tensor rank holds the same values of it."""
    if not is_dtensor(tensor):
        return False
    from torch.distributed.tensor import Shard

    names = tensor.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    return any(n in TENSOR_DIMS and isinstance(p, Shard) for n, p in zip(names, tensor.placements, strict=True))  # type: ignore[attr-defined]
