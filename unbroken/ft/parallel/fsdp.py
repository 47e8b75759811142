"""FSDP2 inside a replica: sharding a model as torchtitan does, and the reduce-scatter the reduction needs.

``apply_fsdp(model, mesh)`` wraps each transformer block (the members of an ``nn.ModuleList`` named ``layers``)
and then the root with ``fully_shard`` on the replica's mesh: a user's own FSDP2 wrapping works as well.
``prepare_fsdp(model, reducer)`` (``Context.register_state`` calls it) sets every FSDP unit up for the fault-
tolerant reduction:

- the intra-replica reduce-scatter SUMs (the library already divides each loss by M), never averages;
- a parameter without a gradient is reduce-scattered as zeros, so the layout is the same every step;
- in exact mode the reduce-scatter is ``ExactReduceScatter``: FSDP hands it this rank's microbatch gradient
  (k rows, one per destination rank, each the concatenation of the unit's padded parameter chunks); each
  parameter's columns are quantised with its power-of-two scale (the same kernel and the same integers as the
  unsharded fold: quantisation is elementwise), the int64 rows are reduce-scattered inside the replica, and
  the int64 shard is added into the reducer's accumulator. Integer sums are associative, so the result does
  not depend on the number of shards, on which rank computed which microbatch, or on the replicas.

A microbatch is never split across the k ranks: each computes whole microbatches, in rounds (a rank with
nothing left in a round computes a padding microbatch that contributes zero).

The per-unit layout (parameter order and padded chunk sizes) is read from FSDP's parameter group, a private
attribute (``_get_fsdp_state()._fsdp_param_group``); ``ExactReduceScatter`` checks its total against the
input FSDP hands it, so a torch upgrade that changes it fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the type the public setter takes

from unbroken.ft.comm import GradientReducer
from unbroken.ft.foldkernel import quantise_sum


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each transformer block (``model.layers``) and then the root, on ``mesh``; returns the
    model (now an ``FSDPModule``)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList | nn.ModuleDict):
        raise ValueError("apply_fsdp needs transformer blocks in a module list named 'layers'")
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass(frozen=True)
class _Segment:
    index: int  # in the reducer's parameters
    padded: int  # elements of one rank's padded chunk of the parameter
    local: int  # elements of this rank's real shard (<= padded)


class ExactReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one unit, replaced by an exact one (see the module docstring)."""

    def __init__(self, reducer: GradientReducer, segments: list[_Segment]) -> None:
        self.reducer = reducer
        self.segments = segments
        self.columns = sum(s.padded for s in segments)

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        reducer = self.reducer
        k = group.size()
        rows = input_tensor.view(k, -1)
        assert rows.shape[1] == self.columns, (rows.shape, self.columns)
        quantised = torch.zeros((k, self.columns), dtype=torch.int64, device=input_tensor.device)
        # No microbatch named: a backward outside the step's (torch's pipelining infers its shapes with one); it
        # takes part in the collective, contributing and keeping nothing.
        outside = reducer.current is None
        if not (reducer.padding or outside):
            column = 0
            for s in self.segments:
                values = rows[:, column : column + s.padded].contiguous()
                out = torch.empty(values.numel(), dtype=torch.int64, device=values.device)
                exponent = reducer.exponents[s.index]
                (value,) = quantise_sum([values], None, out, exponent, reducer.limit)
                if reducer.note(s.index, value):
                    quantised[:, column : column + s.padded] = out.view(k, s.padded)
                column += s.padded
        shard = torch.empty(self.columns, dtype=torch.int64, device=input_tensor.device)
        dist.reduce_scatter_single(shard, quantised.view(-1), group=group)
        output_tensor.zero_()  # FSDP's own float32 gradient: unused, the reducer holds the sum
        if outside:
            return None
        column = 0
        for s in self.segments:
            reducer.accumulate(s.index, shard[column : column + s.local])
            column += s.padded
        return None


def fsdp_buckets(model: nn.Module, params: list[nn.Parameter]) -> list[list[int]] | None:
    """The reduction's buckets for an FSDP model: one per unit, in the order the backward reduce-scatters them
    (the blocks from the last, then the root, which holds the embedding, final norm and output). FSDP calls the
    sharded parameters' post-accumulate-grad hooks once a unit's reduce-scatter has accumulated, so in a step's
    last round each bucket's cross-replica all-reduce starts while the blocks before it are still in their
    backward. None if the model has no FSDP unit, or none shards over more than one rank."""
    units = fsdp_units(model)
    if not units:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    # Modules sharded together (``fully_shard([norm, output])``, as torchtitan does) share one group: one bucket.
    groups = [g for i, g in enumerate(groups) if g is not None and all(g is not h for h in groups[:i])]
    if all(getattr(g.mesh_info, "shard_mesh_size", 1) == 1 for g in groups):
        # FSDP on one rank (torchtitan applies it at any degree, for its mixed precision) neither reduce-scatters
        # nor calls the custom reduce-scatter: its gradients are reduced as an unsharded model's.
        return None
    per_unit = [[index[id(fp.sharded_param)] for fp in g.fsdp_params] for g in groups]
    root, blocks = per_unit[0], per_unit[1:]  # model.modules() lists the root first, then the blocks in order
    return [*reversed(blocks), root]


def prepare_fsdp(model: nn.Module, reducer: GradientReducer) -> bool:
    """Set every FSDP unit of ``model`` up for the fault-tolerant reduction (module docstring); False if the
    model has no FSDP unit. ``reducer`` must hold ``model.parameters()`` in order."""
    units = fsdp_units(model)
    if not units:
        return False
    index = {id(p): i for i, p in enumerate(reducer.params)}
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        unit.set_reduce_scatter_unused_params(True)
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
        if reducer.exact:
            segments = [
                _Segment(
                    index[id(fp.sharded_param)],
                    fp.padded_sharded_param_size.numel(),
                    fp.sharded_param.to_local().numel(),
                )
                for fp in group.fsdp_params
            ]
            unit.set_custom_reduce_scatter(ExactReduceScatter(reducer, segments))
    return True
