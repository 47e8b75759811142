"""Training-time transforms of a model's transformer blocks: activation checkpointing and ``torch.compile``.

Owns ``apply_activation_checkpointing(model)`` and ``apply_compile(model)`` (torchtitan's ``apply_ac`` and
``apply_compile``), the blocks they act on (``transformer_blocks``), and the order in which they combine
with MeCeFO's efficient backward (``unbroken/ft/mecefo/``). ``Context.register_state`` applies them from
``[train] activation_checkpointing`` and ``[train] compile``, so the built-in trainer and a user's own loop
get the same; a loop that builds its model differently may call them itself.

Both act from outside the model and change neither its structure nor its state dict: checkpointing replaces
each block's ``forward`` by one that runs the original under ``torch.utils.checkpoint`` (non-reentrant),
compiling calls each block's ``nn.Module.compile()``. Neither knows about failures, process groups or
precision: autocast is entered by the caller around the forward (``Context.autocast``), and checkpointing
re-enters the forward's autocast state when it recomputes.

With the efficient transform: every transform here acts on a block, the efficient one on the block's four
sub-modules, so they stack in any order. A checkpointed block recomputes its forward during the backward,
and the efficient sub-modules read their on/off switch then: the switch must not change between a forward
and its backward (``Step.backward`` keeps it; a change is caught by checkpoint's determinism check as a
``CheckpointError``, never a silent wrong gradient). Under ``torch.compile`` the exact path (switch off) is
traced and compiled; the efficient path (switch on) runs eagerly (``torch.compiler.disable`` in
``mecefo/transform.py``), since its backward joins a background computation and cannot be traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "apply_compile", "check_compiler", "transformer_blocks"]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model``: the members of every ``nn.ModuleList`` named ``layers`` (ours,
    torchtitan's and Hugging Face's LLaMA-family models), or ``nn.ModuleDict`` (a pipeline stage's).

    Raises:
        ValueError: the model has none.
    """
    blocks = [
        block
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList | nn.ModuleDict) and name.rsplit(".", 1)[-1] == "layers"
        for block in (module.values() if isinstance(module, nn.ModuleDict) else module)
    ]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no transformer blocks (an nn.ModuleList named 'layers'); "
            "activation checkpointing and compile act on them"
        )
    return blocks


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint every transformer block: its forward keeps only its inputs, and the backward recomputes it
    (``torch.utils.checkpoint``, non-reentrant, RNG state preserved). The recomputation runs the same ops on
    the same inputs, so gradients are bitwise those without it on a deterministic backend.

    Raises:
        ValueError: no blocks, or a block already has a patched forward (applied twice).
    """
    for block in transformer_blocks(model):
        if "forward" in block.__dict__:
            raise ValueError(f"{type(block).__name__} already has a patched forward (checkpointing applied twice?)")
        block.forward = _checkpointed(block.forward)


def _checkpointed(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    return forward


def apply_compile(model: nn.Module) -> None:
    """Compile every transformer block with ``torch.compile`` (the default inductor backend; on CPU it needs a
    C++ compiler). Blocks of one shape share one compiled graph. Compilation happens at the first forward;
    a hook added or removed later (fault injection, a user's) or a switch of MeCeFO's efficient mode traces
    again, which is slower once, never wrong.

    Raises:
        ValueError: no blocks, or a block is already compiled.
    """
    for block in transformer_blocks(model):
        if getattr(block, "_compiled_call_impl", None) is not None:
            raise ValueError(f"{type(block).__name__} is already compiled (compile applied twice?)")
        block.compile()


def check_compiler() -> None:
    """ValueError (one line) if ``torch.compile`` cannot work here: inductor on CPU needs a C++ compiler."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except (RuntimeError, OSError) as e:
        raise ValueError(f"train.compile = true needs a C++ compiler for inductor on the CPU ({e})") from None
