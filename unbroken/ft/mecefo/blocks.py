"""The LLaMA-family blocks MeCeFO's efficient mode patches, found by their sub-modules' attribute names.

Owns ``BlockLayout`` and ``LAYOUTS`` (our own names, meta-llama / torchtitan's: ``attention``, ``attention_norm``,
``feed_forward`` with ``w1`` gate, ``w3`` up, ``w2`` down, SiLU; and Hugging Face LLaMA-family decoder layers':
``self_attn``, ``input_layernorm``, ``mlp`` with ``gate_proj``/``up_proj``/``down_proj``/``act_fn``,
``post_attention_layernorm``), ``Block`` (one block's sub-modules, FFN linears and their parameter names) and
``find_blocks`` (every block of a model, refused in one line when there is none or one is patched already), and a
weight as this process holds it (``local_part``) or whole (``whole``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BlockLayout:
    """Attribute names of one LLaMA-family block and of its SwiGLU MLP."""

    attention: str
    attention_norm: str
    mlp: str
    ffn_norm: str
    gate: str
    up: str
    down: str
    act: str | None  # the MLP's activation attribute; None: SiLU, applied by the MLP's own forward


LAYOUTS: tuple[BlockLayout, ...] = (
    BlockLayout("attention", "attention_norm", "feed_forward", "ffn_norm", "w1", "w3", "w2", None),  # ours
    BlockLayout(  # Hugging Face LlamaDecoderLayer (also Mistral, Qwen2 and the like)
        "self_attn", "input_layernorm", "mlp", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "act_fn"
    ),
)


@dataclass(eq=False)
class Block:
    """One block: its sub-modules, its FFN's (gate, up, down) linears and their weights' names in the model, the
    original forwards of the sub-modules patched, and the FFN norm's input and output between the two forwards."""

    index: int
    name: str
    attention: nn.Module
    attention_norm: nn.Module
    mlp: nn.Module
    ffn_norm: nn.Module
    linears: tuple[nn.Linear, nn.Linear, nn.Linear]  # gate, up, down
    act: Callable[[torch.Tensor], torch.Tensor]
    weight_names: tuple[str, str, str]
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)  # sub-module name -> bound forward
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (ffn_norm input, its output) until the MLP runs


def find_blocks(model: nn.Module) -> list[Block]:
    """Every LLaMA-family block of ``model``, in module order.

    Raises:
        ValueError: no block matches ``LAYOUTS``, or one's sub-modules already have a patched forward.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    matches = ((name, module, _layout(module)) for name, module in model.named_modules())
    blocks = [_block(i, name, m, layout, names) for i, (name, m, layout) in enumerate(x for x in matches if x[2])]
    if not blocks:
        raise ValueError(
            f"no LLaMA-family block found in {type(model).__name__}: a block needs the sub-modules of one of "
            + "; ".join(f"({', '.join(_required(layout))})" for layout in LAYOUTS)
        )
    for block in blocks:
        for m in (block.attention, block.attention_norm, block.mlp, block.ffn_norm):
            if "forward" in m.__dict__:
                raise ValueError(f"block {block.name!r} already has a patched forward (transformed twice?)")
    return blocks


def _required(layout: BlockLayout) -> list[str]:
    return [layout.attention, layout.attention_norm, layout.mlp, layout.ffn_norm] + [
        f"{layout.mlp}.{n}" for n in (layout.gate, layout.up, layout.down)
    ]


def _layout(module: nn.Module) -> BlockLayout | None:
    for layout in LAYOUTS:
        subs = [
            getattr(module, a, None) for a in (layout.attention, layout.attention_norm, layout.mlp, layout.ffn_norm)
        ]
        if all(isinstance(s, nn.Module) for s in subs) and all(
            isinstance(getattr(subs[2], a, None), nn.Linear) for a in (layout.gate, layout.up, layout.down)
        ):
            return layout
    return None


def _block(index: int, name: str, module: nn.Module, layout: BlockLayout, names: dict[int, str]) -> Block:
    mlp = getattr(module, layout.mlp)
    linears = tuple(getattr(mlp, a) for a in (layout.gate, layout.up, layout.down))
    return Block(
        index=index,
        name=name,
        attention=getattr(module, layout.attention),
        attention_norm=getattr(module, layout.attention_norm),
        mlp=mlp,
        ffn_norm=getattr(module, layout.ffn_norm),
        linears=linears,
        act=F.silu if layout.act is None else getattr(mlp, layout.act),
        weight_names=tuple(names[id(linear.weight)] for linear in linears),
    )


def local_part(weight: torch.Tensor) -> torch.Tensor:
    """This process's part of ``weight`` (the local part of a ``DTensor``: an FSDP shard, a tensor-parallel slice)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def whole(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` whole (an FSDP ``DTensor`` gathered from the ranks of its replica)."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight
