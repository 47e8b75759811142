"""The built-in LLaMA cut into pipeline stages (torchtitan's ``pipeline_llama``, for ``model.py``'s Transformer).

``pipeline_stage(model, stage, stages)`` keeps the part of a whole ``Transformer`` that stage ``stage`` of
``stages`` runs: the token embedding on the first stage, a contiguous run of blocks on each (the first
stages take one more when they do not divide evenly), the final norm and the output on the last. The kept
modules are the model's own (same parameters, same initialisation as the whole model), and their names
are the whole model's (``layers.5.attention.wq.weight``): the blocks sit in an ``nn.ModuleDict`` keyed by
their index, so a stage's state dict is a piece of the whole one and checkpoints move between layouts.
"""

from __future__ import annotations

import torch
from torch import nn

from unbroken.core.plan import even_quotas
from unbroken.train.model import Transformer


def stage_layers(n_layers: int, stage: int, stages: int) -> range:
    """The blocks of stage ``stage`` (contiguous, the first stages one more when ``stages`` does not divide)."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of {stages} stages")
    if stages > n_layers:
        raise ValueError(f"parallel.pipeline = {stages} exceeds the model's {n_layers} blocks; use at most {n_layers}")
    quotas = even_quotas(n_layers, stages)
    start = sum(quotas[:stage])
    return range(start, start + quotas[stage])


class TransformerStage(nn.Module):
    """A pipeline stage of a ``Transformer``: inputs are token ids on the first stage, hidden states (B, T,
    dim) elsewhere; outputs are hidden states, logits on the last stage."""

    def __init__(self, model: Transformer, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        self.max_seq_len = model.args.max_seq_len
        self.tok_embeddings = model.tok_embeddings if self.first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in stage_layers(len(model.layers), stage, stages)})
        self.norm = model.norm if self.last else None
        self.output = model.output if self.last else None
        self.register_buffer("freqs_cis", model.freqs_cis, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model max_seq_len = {self.max_seq_len}")
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        freqs_cis = self.freqs_cis[:T]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        if self.norm is None or self.output is None:
            return h
        logits = self.output(self.norm(h))
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def pipeline_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of the built-in ``Transformer`` (ValueError for another model)."""
    if not isinstance(model, Transformer):
        raise ValueError(
            f"parallel.pipeline > 1 cuts the built-in LLaMA into stages; {type(model).__name__} is not one "
            "(a model of your own: build its stage yourself, docs/parallel.md)"
        )
    return TransformerStage(model, stage, stages)
