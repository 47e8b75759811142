"""Tensor parallelism inside a replica: a transformer's projections split over the replica's tensor ranks with
torch's own DTensor API (``parallelize_module``), as torchtitan and Megatron split them.

``apply_tensor_parallel(model, mesh, plan, sequence_parallel=False)``: the caller's ``TensorParallelPlan`` names
which submodules of each block are the attention's and the FFN's projections (the library knows no model: the
built-in trainer passes its LLaMA's names, its Hugging Face adapter ``LlamaForCausalLM``'s). In each block the
attention's query, key and value projections and the FFN's two input projections are split by output columns
(each rank computes whole heads and its share of the hidden units, no communication), and the attention's output
projection and the FFN's output projection by input rows (each rank's partial products are all-reduced). The
embedding, the norms and the output layer stay whole on every rank. With ``sequence_parallel`` (a plan that names
the blocks' norms and the model's embedding, final norm and output) the norms work on the rank's share of the
sequence, the row-wise outputs are reduce-scattered instead of all-reduced, the embedding is split by vocabulary
rows and the output layer by columns, as in torchtitan. The tensor degree must divide the query heads, the
key/value heads and the FFN's hidden size; a model that does not fit its plan is refused in one line.

Arithmetic: a row-wise projection sums its ranks' partial products in floating point (a sum of t partials, not
the unsplit dot product), so a layout with tensor degree t > 1 is bitwise itself (the same t, the same kernels)
but not the unsplit model; the fault-tolerant reduction across replicas is unchanged by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which submodules of a transformer tensor parallelism splits, by name: ``layers`` from the model (its blocks,
    an ``nn.ModuleList`` or ``nn.ModuleDict``), the rest from a block (dotted paths below it).

    ``attention`` and ``ffn``: a block's attention and FFN; ``qkv``: the attention's query, key and value
    projections and ``attn_out`` its output projection; ``ffn_in``: the FFN's two input projections (gate, up)
    and ``ffn_out`` its output one (down), all ``nn.Linear`` below ``attention`` / ``ffn``. ``head_dim``: the
    attention's attribute holding one head's width (the head counts are the projections' widths over it);
    ``head_counts``: the attention's attributes holding head counts its forward views by, divided by the degree
    once split (none where the forward infers them, as Hugging Face's does). For sequence parallelism:
    ``norms``, a block's two norms (before the attention, before the FFN), and ``ends``, the model's embedding,
    final norm and output layer; None: the model is split without it."""

    layers: str
    attention: str
    qkv: tuple[str, str, str]
    attn_out: str
    ffn: str
    ffn_in: tuple[str, str]
    ffn_out: str
    head_dim: str = "head_dim"
    head_counts: tuple[str, ...] = ()
    norms: tuple[str, str] | None = None
    ends: tuple[str, str, str] | None = None

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(name under ``layers``, block) of each of ``model``'s blocks; ValueError (one line) unless ``model``
        fits the plan."""
        name = type(model).__name__
        layers = _submodule(model, self.layers)
        if not isinstance(layers, nn.ModuleList | nn.ModuleDict) or len(layers) == 0:
            raise ValueError(
                f"tensor parallelism's plan does not fit {name}: it has no blocks at {self.layers!r} (an "
                "nn.ModuleList or nn.ModuleDict of them); pass the plan of this model's names"
            )
        blocks = list(layers.named_children())
        for path in self.projections():
            if not isinstance(_submodule(blocks[0][1], path), nn.Linear):
                raise ValueError(
                    f"tensor parallelism's plan does not fit {name}: its block {self.layers}.{blocks[0][0]} has no "
                    f"nn.Linear {path!r}; pass the plan of this model's names"
                )
        attention = _submodule(blocks[0][1], self.attention)
        if not isinstance(getattr(attention, self.head_dim, None), int):
            raise ValueError(
                f"tensor parallelism's plan does not fit {name}: its attention has no head width "
                f"{self.attention}.{self.head_dim}; pass the plan of this model's names"
            )
        return blocks

    def projections(self) -> list[str]:
        """The dotted paths, below a block, of the projections the plan splits."""
        return [f"{self.attention}.{n}" for n in (*self.qkv, self.attn_out)] + [
            f"{self.ffn}.{n}" for n in (*self.ffn_in, self.ffn_out)
        ]


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _widths(plan: TensorParallelPlan, block: nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, FFN hidden units) of ``block``."""
    attention = block.get_submodule(plan.attention)
    head_dim: int = getattr(attention, plan.head_dim)
    q, k = (attention.get_submodule(n).out_features for n in plan.qkv[:2])
    return q // head_dim, k // head_dim, block.get_submodule(f"{plan.ffn}.{plan.ffn_in[0]}").out_features


def check_tensor_parallel(model: nn.Module, t: int, plan: TensorParallelPlan, sequence_parallel: bool = False) -> None:
    """ValueError (one line) unless ``apply_tensor_parallel`` can split ``model`` over ``t`` ranks by ``plan`` (a
    model on the meta device will do: nothing is computed)."""
    heads, kv_heads, hidden = _widths(plan, plan.blocks(model)[0][1])
    for what, n in (("query heads", heads), ("key/value heads", kv_heads), ("FFN hidden units", hidden)):
        if n % t:
            raise ValueError(f"parallel.tensor = {t} must divide the model's {what} ({n})")
    if sequence_parallel and (plan.norms is None or plan.ends is None):
        raise ValueError(
            f"parallel.sequence_parallel needs a plan that names the norms, the embedding and the output of "
            f"{type(model).__name__}, and its plan does not; use parallel.sequence_parallel = false"
        )
    if sequence_parallel and plan.ends is not None and any(_submodule(model, n) is None for n in plan.ends):
        raise ValueError(
            "parallel.sequence_parallel does not split a pipeline stage; use it with parallel.pipeline = 1"
        )


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, plan: TensorParallelPlan, sequence_parallel: bool = False
) -> nn.Module:
    """Split ``model``'s projections named by ``plan`` over the one-dimensional ``mesh`` (the replica's tensor
    ranks), in place; returns the model. ValueError (one line) for a model that does not fit ``plan`` or a degree
    that does not divide it."""
    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel takes the tensor dimension of the mesh (1-D), not a {mesh.ndim}-D one")
    t = mesh.size()
    check_tensor_parallel(model, t, plan, sequence_parallel)
    if sequence_parallel:
        assert plan.ends is not None and plan.norms is not None
        embedding, norm, output = plan.ends
        parallelize_module(
            model,
            mesh,
            {
                embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                norm: SequenceParallel(),
                output: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
    for _, block in plan.blocks(model):
        parallelize_module(block, mesh, _block_plan(plan, sequence_parallel))
        attention = block.get_submodule(plan.attention)
        for count in plan.head_counts:  # the forward views its projections by these: each rank holds 1/t of them
            setattr(attention, count, getattr(attention, count) // t)
    return model


def _block_plan(plan: TensorParallelPlan, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    styles: dict[str, ParallelStyle] = {}
    for name in plan.qkv:
        styles[f"{plan.attention}.{name}"] = ColwiseParallel()
    for name in plan.ffn_in:
        styles[f"{plan.ffn}.{name}"] = ColwiseParallel()
    out = Shard(1) if sequence_parallel else Replicate()
    styles[f"{plan.attention}.{plan.attn_out}"] = RowwiseParallel(output_layouts=out)
    styles[f"{plan.ffn}.{plan.ffn_out}"] = RowwiseParallel(output_layouts=out)
    if sequence_parallel:
        assert plan.norms is not None
        for name in plan.norms:
            styles[name] = SequenceParallel()
        styles[plan.attention] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        )
        styles[plan.ffn] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return styles


def tensor_parallel_plan_names(model: nn.Module, plan: TensorParallelPlan) -> list[str]:
    """The fully qualified names of the parameters ``apply_tensor_parallel`` splits (for checks and docs)."""
    return [f"{plan.layers}.{key}.{path}.weight" for key, _ in plan.blocks(model) for path in plan.projections()]
