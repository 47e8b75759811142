"""MeCeFO's efficient mode: the cheap backward a neighbour uses for the microbatches it covers.

Owns ``apply_efficient_backward(model, cfg)``, a training-time transform applied from outside the model
(``model.py`` stays the reference), and the ``EfficientBackward`` handle it returns: the per-microbatch
on/off switch and the low-rank projection bases. It knows the LLaMA block structure and nothing about
training loops, process groups or failures; the trainer decides which microbatches run efficiently and
how the attention gradients (absent for those microbatches) are averaged. By concern: ``transform`` (the
transform and its handle), ``blocks`` (finding the blocks), ``patches`` (the forwards patched into each block and
the FFN's backward), ``bases`` (the low-rank bases, ``EfficientConfig``).

With the mode on, a forward pass computes exactly the same values as the model's own forward, but its
backward applies the three techniques of MeCeFO (paper sections 3.2-3.4, docs: reference/mecefo.md 2.3-2.5):

1. Skip-connection. Every attention sub-block (pre-attention norm and attention) runs under
   ``torch.no_grad()``: nothing is kept for its backward, the gradient reaches the block input through
   the residual alone, and no attention parameter (nor the pre-attention norm weight) gets a gradient
   from that microbatch: their ``.grad`` is left as it was (``None`` when nothing else wrote it).
2. FFN recomputation. Per block, only the FFN sub-block's input ``h`` (the input of the pre-FFN norm,
   i.e. the residual stream after attention) is kept. The backward recomputes the norm, ``gate(x)``,
   ``up(x)`` and the activation from it, under the autocast state the forward ran in; the input gradient
   (to ``h``) and the norm weight gradient are exact. Keeping ``h`` rather than the norm output saves the
   norm's own saved tensors too, so a block keeps one (tokens x dim) tensor in all.
3. Low-rank FFN weight gradient. For each FFN linear ``y = x W^T`` (gate, up, down), the weight gradient
   ``G_y^T x`` is replaced by ``G_y^T (x V) V^T``, where V (in_features x r) holds (an estimate of) the
   top-r right singular vectors of W. A matrix with ``rank >= in_features`` gets its exact weight
   gradient (no projection).

With the mode off, every patched module calls its original bound ``forward``, so exact microbatches are
bit-identical to the untransformed model.

Blocks are found by attribute names, so models we did not write work too: ``LAYOUTS`` lists our own
(meta-llama / torchtitan names) and Hugging Face LLaMA-family decoder layers. The transform patches the four
sub-modules' ``forward``, never the block's, so whatever the block's signature and return type, it works as long
as the block computes ``h = x + attention(attention_norm(x)); out = h + mlp(ffn_norm(h))``. A block whose MLP input
is not its ``ffn_norm`` output (e.g. Gemma-2's extra norms) is detected at the first efficient forward and raises
``RuntimeError``. Activation checkpointing of the blocks (``transforms.py``) works on top: its recomputation reads
the switch again, so the switch must not change between a forward and its backward (a change is caught by
checkpoint's determinism check). Under ``torch.compile`` the efficient forwards are excluded from tracing
(``torch.compiler.disable``) and run eagerly; the exact path is compiled. Hugging Face's own gradient
checkpointing is refused.

The bases (``bases``) are a pure function of the weights and the step they were taken at, computed once per
tau-window when first needed, on a background thread; they live in the handle, not in the model, so the model's
state dict and parameter checksums are unaffected; ``bases()`` / ``load_bases(bases, step)`` let a trainer
checkpoint or send them, with ``bases_step``, to a rejoining worker.
"""

from unbroken.ft.mecefo.bases import (
    DEFAULT_OVERSAMPLE,
    DEFAULT_POWER_ITERS,
    DEFAULT_RANK,
    EfficientConfig,
    basis_seed,
    randomized_basis,
)
from unbroken.ft.mecefo.blocks import LAYOUTS, BlockLayout
from unbroken.ft.mecefo.transform import EfficientBackward, apply_efficient_backward

__all__ = [
    "DEFAULT_OVERSAMPLE",
    "DEFAULT_POWER_ITERS",
    "DEFAULT_RANK",
    "LAYOUTS",
    "BlockLayout",
    "EfficientBackward",
    "EfficientConfig",
    "apply_efficient_backward",
    "basis_seed",
    "randomized_basis",
]
