"""Tensor parallelism inside a replica: a transformer's projections split over the replica's tensor ranks with
torch's own DTensor API (``parallelize_module``), as torchtitan and Megatron split them.

``apply_tensor_parallel(model, mesh, sequence_parallel=False)``: in each block the attention's query, key and value
projections and the FFN's two input projections are split by output columns (each rank computes whole heads and
its share of the hidden units, no communication), and the attention's output projection and the FFN's output
projection by input rows (each rank's partial products are all-reduced). The embedding, the norms and the output
layer stay whole on every rank. With ``sequence_parallel`` (the built-in model only) the norms work on the
rank's share of the sequence, the row-wise outputs are reduce-scattered instead of all-reduced, the embedding is
split by vocabulary rows and the output layer by columns, as in torchtitan.

Works on the built-in ``Transformer`` (whole or a pipeline stage of it) and on Hugging Face's ``LlamaForCausalLM``
(by their module names). The
tensor degree must divide the query heads, the key/value heads and the FFN's hidden size.

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
class _BlockNames:
    """Where a model's block keeps what tensor parallelism splits."""

    attention: str
    qkv: tuple[str, str, str]
    attn_out: str
    ffn: str
    ffn_in: tuple[str, str]
    ffn_out: str
    norms: tuple[str, str]


_BUILTIN = _BlockNames(
    "attention", ("wq", "wk", "wv"), "wo", "feed_forward", ("w1", "w3"), "w2", ("attention_norm", "ffn_norm")
)
_HF_LLAMA = _BlockNames(
    "self_attn",
    ("q_proj", "k_proj", "v_proj"),
    "o_proj",
    "mlp",
    ("gate_proj", "up_proj"),
    "down_proj",
    ("input_layernorm", "post_attention_layernorm"),
)


def _shape(model: nn.Module) -> tuple[_BlockNames, list[nn.Module], int, int, int]:
    """(module names, blocks, query heads, key/value heads, FFN hidden size) of a supported model: the built-in
    ``Transformer``, a pipeline stage of it (``train.stages.TransformerStage``), or ``LlamaForCausalLM``."""
    from unbroken.train.model import Transformer
    from unbroken.train.stages import TransformerStage

    if isinstance(model, Transformer | TransformerStage):
        blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
        a = blocks[0].attention
        return _BUILTIN, blocks, a.n_heads, a.n_kv_heads, blocks[0].feed_forward.w1.out_features
    config = getattr(model, "config", None)
    if type(model).__name__ == "LlamaForCausalLM" and config is not None:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        return _HF_LLAMA, list(model.model.layers), heads, kv_heads, config.intermediate_size
    raise ValueError(
        f"tensor parallelism supports the built-in Transformer and Hugging Face's LlamaForCausalLM, not "
        f"{type(model).__name__}; a model of your own: call torch's parallelize_module on it with ctx.mesh['tensor']"
    )


def check_tensor_parallel(model: nn.Module, t: int, sequence_parallel: bool = False) -> None:
    """ValueError (one line) unless ``apply_tensor_parallel`` can split ``model`` over ``t`` ranks (a model on the
    meta device will do: nothing is computed)."""
    names, _, heads, kv_heads, hidden = _shape(model)
    for what, n in (("query heads", heads), ("key/value heads", kv_heads), ("FFN hidden units", hidden)):
        if n % t:
            raise ValueError(f"parallel.tensor = {t} must divide the model's {what} ({n})")
    if sequence_parallel and names is not _BUILTIN:
        raise ValueError("parallel.sequence_parallel supports the built-in model only (not Hugging Face's)")
    if sequence_parallel and not hasattr(model, "args"):
        raise ValueError(
            "parallel.sequence_parallel does not split a pipeline stage; use it with parallel.pipeline = 1"
        )


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model``'s projections over the one-dimensional ``mesh`` (the replica's tensor ranks), in place;
    returns the model. ValueError (one line) for a model it does not know or a degree that does not divide it."""
    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel takes the tensor dimension of the mesh (1-D), not a {mesh.ndim}-D one")
    t = mesh.size()
    check_tensor_parallel(model, t, sequence_parallel)
    names, blocks, *_ = _shape(model)
    builtin = names is _BUILTIN
    if sequence_parallel:
        parallelize_module(
            model,
            mesh,
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
    for block in blocks:
        plan: dict[str, ParallelStyle] = {}
        for name in names.qkv:
            plan[f"{names.attention}.{name}"] = ColwiseParallel()
        for name in names.ffn_in:
            plan[f"{names.ffn}.{name}"] = ColwiseParallel()
        out = Shard(1) if sequence_parallel else Replicate()
        plan[f"{names.attention}.{names.attn_out}"] = RowwiseParallel(output_layouts=out)
        plan[f"{names.ffn}.{names.ffn_out}"] = RowwiseParallel(output_layouts=out)
        if sequence_parallel:
            for name in names.norms:
                plan[name] = SequenceParallel()
            plan[names.attention] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan[names.ffn] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, plan)
        if builtin:
            # The built-in attention views its projections by its head counts: each rank now holds 1/t of them.
            attention = block.attention
            attention.n_heads //= t
            attention.n_kv_heads //= t
    return model


def tensor_parallel_plan_names(model: nn.Module) -> list[str]:
    """The fully qualified names of the parameters ``apply_tensor_parallel`` splits (for checks and docs)."""
    names, blocks, *_ = _shape(model)
    prefix = "layers" if names is _BUILTIN else "model.layers"
    split = []
    for i, _ in enumerate(blocks):  # (a whole model's blocks: a stage's are numbered by their index)
        split += [f"{prefix}.{i}.{names.attention}.{n}.weight" for n in (*names.qkv, names.attn_out)]
        split += [f"{prefix}.{i}.{names.ffn}.{n}.weight" for n in (*names.ffn_in, names.ffn_out)]
    return split
