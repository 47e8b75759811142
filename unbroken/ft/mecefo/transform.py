"""MeCeFO's transform: ``apply_efficient_backward(model, cfg)`` and the ``EfficientBackward`` handle it returns.

Owns the per-microbatch on/off switch and the patching of every block's four sub-modules (``patches``: their
efficient forwards; ``blocks``: finding the blocks), over the block's low-rank bases (``bases.LowRankBases``),
which the handle's ``refresh``, ``wait``, ``bases`` and ``load_bases`` reach. With the mode off, every patched
module calls its original bound ``forward``, so exact microbatches are bit-identical to the untransformed model.
Under ``torch.compile`` the efficient forwards are excluded from tracing (``torch.compiler.disable``) and run
eagerly; the exact path is compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from unbroken.ft.mecefo.bases import EfficientConfig, LowRankBases
from unbroken.ft.mecefo.blocks import Block, find_blocks
from unbroken.ft.mecefo.patches import ffn_norm_forward, mlp_forward, no_grad


class EfficientBackward:
    """The handle ``apply_efficient_backward`` returns: the on/off switch and the projection bases.

    Call order: ``refresh(step, needed)`` once a step's plan is known, on every worker, with the same
    ``needed`` on all of them (whether any worker runs an efficient microbatch in this step); then run each
    efficient microbatch's forward inside ``with eb.enabled():``. The mode is read during the forward; the
    backward may run inside or after the context. Before anything writes the weights, the computation
    ``refresh`` may have started must be joined: ``wait()`` does it, and so does every ``torch.optim``
    optimizer's ``step()`` (a global step pre-hook, removed by ``remove()``); write the weights any other
    way (``load_state_dict``, a custom optimizer) only after ``wait()``.

    The bases used for step s are a pure function of the weights at ``bases_step``, the first step of s's
    tau-window at which ``refresh(..., needed=True)`` was called, and of that step number; no bases exist
    before the first such call (``bases()`` is then empty). A worker that joins or resumes gets the
    current ones, with their step, through ``load_bases(bases, step)``.
    """

    def __init__(self, blocks: list[Block], config: EfficientConfig) -> None:
        self.config = config
        self._blocks = blocks
        self._on = False
        self._bases = LowRankBases(blocks, config)

    # -- the switch ---------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether forwards run now are efficient."""
        return self._on

    def set_active(self, on: bool) -> None:
        """Switch efficient mode on or off for the forwards that follow (``enabled()`` as a context)."""
        self._on = on

    @contextlib.contextmanager
    def enabled(self, on: bool = True) -> Iterator[None]:
        """Run forwards inside the context in efficient mode (``on=False``: exact; for one code path)."""
        previous, self._on = self._on, on
        try:
            yield
        finally:
            self._on = previous

    # -- the bases (``bases.LowRankBases``) -----------------------------------------------------------------
    @property
    def bases_step(self) -> int | None:
        """The step whose weights the bases come from (those in flight, if a computation is); None: none yet."""
        return self._bases.bases_step

    def refresh(self, step: int, needed: bool = True) -> bool:
        """Start computing the bases of ``step``'s tau-window if ``needed`` and they are not held or in flight;
        returns whether it started (``LowRankBases.refresh``)."""
        return self._bases.refresh(step, needed)

    def wait(self) -> None:
        """Join the computation ``refresh`` started, if any (``LowRankBases.wait``)."""
        self._bases.wait()

    def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for a computation of bases in flight (call before the interpreter exits)."""
        self._bases.settle(timeout_s)

    def bases(self) -> list[torch.Tensor]:
        """The V tensors, block by block, gate, up, down; exact-gradient matrices skipped (``LowRankBases.bases``)."""
        return self._bases.bases()

    def named_bases(self) -> dict[str, torch.Tensor]:
        """``bases()`` keyed by the name of the FFN weight each one projects."""
        return self._bases.named_bases()

    def empty_named_bases(self) -> dict[str, torch.Tensor]:
        """``named_bases()``'s names and shapes, uninitialised: what a sharded checkpoint's are read into."""
        return self._bases.empty_named_bases()

    def load_bases(self, bases: list[torch.Tensor], step: int | None = None) -> None:
        """Replace the bases with copies of ``bases`` taken from the weights of ``step`` (``LowRankBases.load_bases``;
        ValueError if they do not match)."""
        self._bases.load_bases(bases, step)

    def load_named_bases(self, bases: dict[str, torch.Tensor], step: int | None = None) -> None:
        """``load_bases`` from bases keyed by weight name (ValueError if they do not match)."""
        self._bases.load_named_bases(bases, step)

    # -- the patched blocks -------------------------------------------------------------------------------
    def attention_parameters(self) -> list[nn.Parameter]:
        """The parameters an efficient microbatch gives no gradient to: attention and pre-attention norm."""
        return [p for b in self._blocks for m in (b.attention_norm, b.attention) for p in m.parameters()]

    def remove(self) -> None:
        """Restore the original forwards and remove the optimizer hook; the handle is unusable afterwards."""
        self._bases.close()
        for block in self._blocks:
            for attr in block.originals:
                del getattr(block, attr).__dict__["forward"]
            block.originals.clear()
        self._blocks = []

    def _patch(
        self, block: Block, attr: str, make_efficient: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        module = getattr(block, attr)
        original = module.forward  # the bound method; calling it is exactly the unpatched module
        block.originals[attr] = original
        # Under torch.compile the exact path (switch off) is traced; the efficient one runs eagerly: its backward
        # joins the basis computation of a background thread, which cannot be traced.
        efficient = torch.compiler.disable(make_efficient(original))

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._on:
                return efficient(*args, **kwargs)
            return original(*args, **kwargs)

        module.forward = forward

    def _install(self) -> None:
        for block in self._blocks:
            self._patch(block, "attention_norm", no_grad)
            self._patch(block, "attention", no_grad)
            self._patch(block, "ffn_norm", lambda original, b=block: ffn_norm_forward(b, original))
            self._patch(block, "mlp", lambda original, b=block: mlp_forward(b, original, self._bases.of_block))


def apply_efficient_backward(model: nn.Module, config: EfficientConfig | None = None) -> EfficientBackward:
    """Patch every LLaMA-family block of ``model`` for MeCeFO's efficient mode (off until ``enabled()``).

    Adds no parameters or buffers and computes nothing yet: the bases are computed when first needed (see
    ``EfficientBackward`` for the call order).

    Raises:
        ValueError: no block matches ``LAYOUTS``, the model was already transformed, or it uses
            Hugging Face gradient checkpointing (checked here only: do not enable it afterwards).
    """
    config = config or EfficientConfig()
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("efficient mode does not support gradient checkpointing of the blocks; disable it")
    handle = EfficientBackward(find_blocks(model), config)
    handle._install()
    return handle
