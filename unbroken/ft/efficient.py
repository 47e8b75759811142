"""MeCeFO's efficient mode: the cheap backward a neighbour uses for the microbatches it covers.

Owns ``apply_efficient_backward(model, cfg)``, a training-time transform applied from outside the model
(``model.py`` stays the reference), and the ``EfficientBackward`` handle it returns: the per-microbatch
on/off switch and the low-rank projection bases. It knows the LLaMA block structure and nothing about
training loops, process groups or failures; the trainer decides which microbatches run efficiently and
how the attention gradients (absent for those microbatches) are averaged.

With the mode on, a forward pass computes exactly the same values as the model's own forward, but its
backward applies the three techniques of MeCeFO (paper sections 3.2-3.4, docs: reference/mecefo.md 2.3-2.5):

1. Skip-connection. Every attention sub-block (pre-attention norm and attention) runs under
   ``torch.no_grad()``: nothing is kept for its backward, the gradient reaches the block input through
   the residual alone, and no attention parameter (nor the pre-attention norm weight) gets a gradient
   from that microbatch: their ``.grad`` is left as it was (``None`` when nothing else wrote it).
2. FFN recomputation. Per block, only the FFN sub-block's input ``h`` (the input of the pre-FFN norm,
   i.e. the residual stream after attention) is kept. The backward recomputes the norm, ``gate(x)``,
   ``up(x)`` and the activation from it; the input gradient (to ``h``) and the norm weight gradient are
   exact. Keeping ``h`` rather than the norm output saves the norm's own saved tensors too, so a block
   keeps one (tokens x dim) tensor in all.
3. Low-rank FFN weight gradient. For each FFN linear ``y = x W^T`` (gate, up, down), the weight gradient
   ``G_y^T x`` is replaced by ``G_y^T (x V) V^T``, where V (in_features x r) holds the top-r right
   singular vectors of W. ``refresh(step)`` recomputes V every ``refresh_every`` steps (the paper's
   tau = 100). A matrix with ``rank >= in_features`` gets its exact weight gradient (no projection).

With the mode off, every patched module calls its original bound ``forward``, so exact microbatches are
bit-identical to the untransformed model.

Blocks are found by attribute names, so models we did not write work too: ``LAYOUTS`` lists our own
(meta-llama / torchtitan names: ``attention``, ``attention_norm``, ``feed_forward`` with ``w1`` gate,
``w3`` up, ``w2`` down, SiLU) and Hugging Face LLaMA-family decoder layers (``self_attn``,
``input_layernorm``, ``mlp`` with ``gate_proj``/``up_proj``/``down_proj``/``act_fn``,
``post_attention_layernorm``). The transform patches the four sub-modules' ``forward``, never the
block's, so whatever the block's signature and return type, it works as long as the block computes
``h = x + attention(attention_norm(x)); out = h + mlp(ffn_norm(h))``. A block whose MLP input is not
its ``ffn_norm`` output (e.g. Gemma-2's extra norms) is detected at the first efficient forward and
raises ``RuntimeError``. Not supported: activation checkpointing of the blocks (a re-forward during
backward would read the switch at backward time) and autocast (the backward recompute does not restore
the forward's autocast state).

The bases are a function of the weights only: ``torch.linalg.svd`` in float64 on CPU with one intra-op
thread, so every worker of one torch build and CPU type computes bit-identical V from identical weights
(float64 because the error of a computed singular subspace grows as machine epsilon over the gap
between the r-th and (r+1)-th singular values, which can be small). They live in the handle, not in
the model (no parameters or buffers), so the model's state dict and parameter checksums are
unaffected; ``bases()`` / ``load_bases()`` let a trainer checkpoint or broadcast them. The SVD's cost
grows as in_features^2 x out_features (docs/benchmarks.md, "MeCeFO", has the figures).

``DEFAULT_RANK`` (64) was chosen from the gradient-error measurements in docs/benchmarks.md ("MeCeFO"):
the FFN weight-gradient error falls slowly with r, and 64 reaches the paper's error level for about half
of the exact weight-gradient cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DEFAULT_RANK", "LAYOUTS", "BlockLayout", "EfficientBackward", "EfficientConfig", "apply_efficient_backward"]

DEFAULT_RANK = 64


@dataclass(frozen=True)
class EfficientConfig:
    """The transform's settings: rank r of the FFN weight-gradient projection and the refresh period tau
    (steps) of its bases (a run's ``[mecefo]`` section)."""

    rank: int = DEFAULT_RANK
    refresh_every: int = 100

    def __post_init__(self) -> None:
        if self.rank < 1 or self.refresh_every < 1:
            raise ValueError(
                f"efficient mode needs rank >= 1 and refresh_every >= 1 (got {self.rank}, {self.refresh_every})"
            )


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
class _Block:
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


class EfficientBackward:
    """The handle ``apply_efficient_backward`` returns: the on/off switch and the projection bases.

    Call order: ``refresh(step)`` at the start of each optimizer step, before its forwards, on every
    worker whether or not it runs efficient microbatches, so that all workers hold the same bases; then
    run each efficient microbatch's forward inside ``with eb.enabled():``. The mode is read during the
    forward; the backward may run inside or after the context. The bases exist from the start (computed
    from the weights at ``apply_efficient_backward`` time, the same as ``refresh(0)`` on a freshly
    initialised model), so ``bases()`` always has the same shapes: a worker that joins late or resumes
    gets the current ones with ``load_bases`` (or by copying into ``bases()``).
    """

    def __init__(self, blocks: list[_Block], config: EfficientConfig) -> None:
        self.config = config
        self._blocks = blocks
        self._on = False
        self._bases = self._compute()
        self.bases_step: int | None = None  # the step of the last refresh; None: from the weights at apply time

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

    def refresh(self, step: int) -> bool:
        """Recompute the bases from the current weights when ``step % refresh_every == 0``.

        Returns whether they were recomputed. New tensors replace the old ones, so a forward already run
        keeps the bases it saw; still, call it between steps, not between a forward and its backward.
        """
        if step % self.config.refresh_every:
            return False
        self._bases = self._compute()
        self.bases_step = step
        return True

    def bases(self) -> list[torch.Tensor]:
        """The V tensors (in_features x r): block by block, gate, up, down; exact-gradient matrices skipped.

        The same count and shapes for every handle built from the same model shape and config, for
        checkpoints and state broadcasts; copying into them in place updates the handle.
        """
        return [v for vs in self._bases for v in vs if v is not None]

    def named_bases(self) -> dict[str, torch.Tensor]:
        """``bases()`` keyed by the name of the FFN weight each one projects."""
        return {
            name: v
            for block, vs in zip(self._blocks, self._bases, strict=True)
            for name, v in zip(block.weight_names, vs, strict=True)
            if v is not None
        }

    def load_bases(self, bases: list[torch.Tensor]) -> None:
        """Replace the bases with copies of ``bases`` (as returned by ``bases()``, e.g. from a checkpoint).

        Raises:
            ValueError: their count or shapes do not match this handle's (another model shape or rank).
        """
        own = self.bases()
        if [tuple(t.shape) for t in bases] != [tuple(t.shape) for t in own]:
            raise ValueError(
                f"MeCeFO bases do not match: got {len(bases)} of shapes {sorted({tuple(t.shape) for t in bases})}, "
                f"expected {len(own)} of shapes {sorted({tuple(t.shape) for t in own})} (another model or rank?)"
            )
        loaded = iter(bases)
        self._bases = [
            tuple(None if v is None else next(loaded).detach().to(v.device, v.dtype).clone() for v in vs)
            for vs in self._bases
        ]

    def _compute(self) -> list[tuple[torch.Tensor | None, ...]]:
        return [tuple(_basis(linear.weight, self.config.rank) for linear in b.linears) for b in self._blocks]

    def attention_parameters(self) -> list[nn.Parameter]:
        """The parameters an efficient microbatch gives no gradient to: attention and pre-attention norm."""
        return [p for b in self._blocks for m in (b.attention_norm, b.attention) for p in m.parameters()]

    def remove(self) -> None:
        """Restore the original forwards; the handle is unusable afterwards."""
        for block in self._blocks:
            for attr in block.originals:
                del getattr(block, attr).__dict__["forward"]
            block.originals.clear()
        self._blocks = []

    # -- the patched forwards -----------------------------------------------------------------------------

    def _patch(
        self, block: _Block, attr: str, make_efficient: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        module = getattr(block, attr)
        original = module.forward  # the bound method; calling it is exactly the unpatched module
        block.originals[attr] = original
        efficient = make_efficient(original)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._on:
                return efficient(*args, **kwargs)
            return original(*args, **kwargs)

        module.forward = forward

    def _install(self) -> None:
        for block in self._blocks:
            self._patch(block, "attention_norm", _no_grad)
            self._patch(block, "attention", _no_grad)
            self._patch(block, "ffn_norm", lambda original, b=block: _ffn_norm_forward(b, original))
            self._patch(block, "mlp", lambda original, b=block: self._mlp_forward(b, original))

    def _mlp_forward(self, block: _Block, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            pending, block.pending = block.pending, None
            if pending is None or pending[1] is not x:
                raise RuntimeError(
                    f"block {block.name!r}: the MLP input is not the output of its pre-FFN norm, so the block "
                    "is not a pre-norm LLaMA block and efficient mode cannot be applied to it"
                )
            gate, up, down = block.linears
            return _EfficientFFN.apply(
                pending[0],
                x,
                block,
                original,
                self._bases[block.index],
                gate.weight,
                up.weight,
                down.weight,
                gate.bias,
                up.bias,
                down.bias,
                *block.ffn_norm.parameters(),
            )

        return forward


def apply_efficient_backward(model: nn.Module, config: EfficientConfig | None = None) -> EfficientBackward:
    """Patch every LLaMA-family block of ``model`` for MeCeFO's efficient mode (off until ``enabled()``).

    Adds no parameters or buffers; computes the first bases from the current weights (see
    ``EfficientBackward`` for the call order).

    Raises:
        ValueError: no block matches ``LAYOUTS``, the model was already transformed, or it uses
            Hugging Face gradient checkpointing (checked here only: do not enable it afterwards).
    """
    config = config or EfficientConfig()
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("efficient mode does not support gradient checkpointing of the blocks; disable it")
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
    handle = EfficientBackward(blocks, config)
    handle._install()
    return handle


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


def _block(index: int, name: str, module: nn.Module, layout: BlockLayout, names: dict[int, str]) -> _Block:
    mlp = getattr(module, layout.mlp)
    linears = tuple(getattr(mlp, a) for a in (layout.gate, layout.up, layout.down))
    return _Block(
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


def _ffn_norm_forward(block: _Block, original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(h: torch.Tensor) -> torch.Tensor:
        # No graph here: the MLP's Function keeps h and recomputes the norm during backward.
        with torch.no_grad():
            out = original(h)
        block.pending = (h, out)
        return out

    return forward


def _no_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return original(*args, **kwargs)

    return forward


def _basis(weight: torch.Tensor, rank: int) -> torch.Tensor | None:
    """Top-``rank`` right singular vectors of ``weight`` (in_features x rank), or None when rank >= in_features."""
    if rank >= weight.shape[1]:
        return None
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # LAPACK/BLAS results may depend on the thread count
    try:
        _, _, vh = torch.linalg.svd(w, full_matrices=False)
    finally:
        torch.set_num_threads(threads)
    return vh[:rank].T.to(device=weight.device, dtype=weight.dtype).contiguous()


def _weight_grad(g_out: torch.Tensor, inp: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """(N, out) and (N, in) -> the (out, in) weight gradient, projected onto span(basis) when given."""
    if basis is None:
        return g_out.T @ inp
    return (g_out.T @ (inp @ basis)) @ basis.T


class _EfficientFFN(torch.autograd.Function):
    """``mlp(ffn_norm(h))`` keeping only ``h``; backward recomputes and projects the weight gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        x: torch.Tensor,
        block: _Block,
        mlp_forward: Callable[[torch.Tensor], torch.Tensor],
        bases: tuple[torch.Tensor | None, ...],
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        b_gate: torch.Tensor | None,
        b_up: torch.Tensor | None,
        b_down: torch.Tensor | None,
        *norm_params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.block = block
        ctx.bases = bases
        ctx.save_for_backward(h, w_gate, w_up, w_down, b_gate, b_up, b_down)
        # x is the norm output computed without a graph; the original forward gives the exact values.
        return mlp_forward(x)

    @staticmethod
    def backward(ctx: Any, g_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, w_gate, w_up, w_down, b_gate, b_up, b_down = ctx.saved_tensors
        block: _Block = ctx.block
        v_gate, v_up, v_down = ctx.bases
        norm_params = list(block.ffn_norm.parameters())
        trained = [p for p in norm_params if p.requires_grad]
        with torch.enable_grad():
            h_r = h.detach().requires_grad_()
            x_r = block.originals["ffn_norm"](h_r)  # (B, T, dim)
        x = x_r.detach().reshape(-1, x_r.shape[-1])  # (N, dim)
        g_y = g_y.reshape(-1, g_y.shape[-1])  # (N, dim)
        a = F.linear(x, w_gate, b_gate)  # (N, hidden)
        u = F.linear(x, w_up, b_up)
        with torch.enable_grad():
            a_r = a.requires_grad_()
            s_r = block.act(a_r)
        s = s_r.detach()
        g_p = g_y @ w_down  # (N, hidden)
        (g_a,) = torch.autograd.grad(s_r, a_r, g_p * u)
        g_u = g_p * s
        g_x = g_a @ w_gate + g_u @ w_up  # (N, dim)
        g_h, *g_trained = torch.autograd.grad(x_r, [h_r, *trained], g_x.view_as(x_r))
        by_param = dict(zip(map(id, trained), g_trained, strict=True))
        g_norm = [by_param.get(id(p)) for p in norm_params]

        needs = ctx.needs_input_grad
        g_w_gate = _weight_grad(g_a, x, v_gate) if needs[5] else None
        g_w_up = _weight_grad(g_u, x, v_up) if needs[6] else None
        g_w_down = _weight_grad(g_y, s * u, v_down) if needs[7] else None
        g_b_gate = g_a.sum(0) if b_gate is not None and needs[8] else None
        g_b_up = g_u.sum(0) if b_up is not None and needs[9] else None
        g_b_down = g_y.sum(0) if b_down is not None and needs[10] else None
        return (g_h, None, None, None, None, g_w_gate, g_w_up, g_w_down, g_b_gate, g_b_up, g_b_down, *g_norm)
