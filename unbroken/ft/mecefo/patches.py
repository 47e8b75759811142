"""The forwards MeCeFO's efficient mode patches into each block, and the FFN's cheap backward.

Owns what a block computes in efficient mode (paper sections 3.2-3.4): the attention and its norm under
``torch.no_grad()`` (``no_grad``: the gradient reaches the block input through the residual alone), the FFN norm
without a graph (``ffn_norm_forward``: its input is kept for the backward), and the FFN as one autograd Function
(``mlp_forward``, ``EfficientFFN``) whose backward recomputes the norm and the activation from that input under the
forward's autocast state and replaces each FFN weight gradient ``G_y^T x`` by ``G_y^T (x V) V^T``, with V the
weight's low-rank basis (``bases``). On tensor-split weights each rank computes with its columns of gate and up
and its rows of down, and the ranks sum their shares of the input's gradient and of down's projection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unbroken.ft.mecefo.blocks import Block, local_part

BasesOf = Callable[[int], Callable[[], tuple[torch.Tensor | None, ...]]]  # block index -> what its backward calls


def ffn_norm_forward(block: Block, original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(h: torch.Tensor) -> torch.Tensor:
        # No graph here: the MLP's Function keeps h and recomputes the norm during backward.
        with torch.no_grad():
            out = original(h)
        block.pending = (h, out)
        return out

    return forward


def no_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return original(*args, **kwargs)

    return forward


def mlp_forward(block: Block, original: Callable[..., Any], bases_of: BasesOf) -> Callable[..., Any]:
    """The MLP's efficient forward: its output by ``original``, its backward by ``EfficientFFN``."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        pending, block.pending = block.pending, None
        if pending is None or pending[1] is not x:
            raise RuntimeError(
                f"block {block.name!r}: the MLP input is not the output of its pre-FFN norm, so the block "
                "is not a pre-norm LLaMA block and efficient mode cannot be applied to it"
            )
        gate, up, down = block.linears
        return EfficientFFN.apply(
            pending[0],
            x,
            block,
            original,
            bases_of(block.index),
            gate.weight,
            up.weight,
            down.weight,
            gate.bias,
            up.bias,
            down.bias,
            *block.ffn_norm.parameters(),
        )

    return forward


def _weight_grad(g_out: torch.Tensor, inp: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """(N, out) and (N, in) -> the (out, in) weight gradient, projected onto span(basis) when given."""
    if basis is None:
        return g_out.T @ inp
    return (g_out.T @ (inp @ basis)) @ basis.T


class EfficientFFN(torch.autograd.Function):
    """``mlp(ffn_norm(h))`` keeping only ``h``; backward recomputes and projects the weight gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        x: torch.Tensor,
        block: Block,
        mlp_forward: Callable[[torch.Tensor], torch.Tensor],
        bases: Callable[[], tuple[torch.Tensor | None, ...]],
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
        ctx.autocast = _autocast_state(h.device.type)
        ctx.save_for_backward(h, w_gate, w_up, w_down, b_gate, b_up, b_down)
        # x is the norm output computed without a graph; the original forward gives the exact values.
        return mlp_forward(x)

    @staticmethod
    def backward(ctx: Any, g_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, *params = ctx.saved_tensors
        # Tensor-parallel weights (DTensors): this rank computes with its columns of gate and up and its rows of
        # down, and sums what the ranks' shares make of the input's gradient (``_sum_over``).
        mesh = getattr(params[0], "device_mesh", None)
        w_gate, w_up, w_down, b_gate, b_up, b_down = (local_part(t) if t is not None else None for t in params)
        block: Block = ctx.block
        v_gate, v_up, v_down = ctx.bases()  # joins the basis computation for this block, if still in flight
        norm_params = list(block.ffn_norm.parameters())
        trained = [p for p in norm_params if p.requires_grad]
        needs = ctx.needs_input_grad
        # Re-enter the forward's autocast state (the backward runs on another thread, or outside the forward's
        # context), so that every op below runs in the precision the same op had, or would have had, in it.
        with torch.autocast(**ctx.autocast):
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
            (g_a,) = torch.autograd.grad(s_r, a_r, (g_p * u).to(s_r.dtype))
            g_u = g_p * s
            g_x = g_a @ w_gate + g_u @ w_up  # (N, dim)
            if mesh is not None:
                g_x = _sum_over(g_x, mesh)
            g_h, *g_trained = torch.autograd.grad(x_r, [h_r, *trained], g_x.view_as(x_r).to(x_r.dtype))
            g_w_gate = _weight_grad(g_a, x, v_gate).to(w_gate.dtype) if needs[5] else None
            g_w_up = _weight_grad(g_u, x, v_up).to(w_up.dtype) if needs[6] else None
            if not needs[7]:
                g_w_down = None
            elif mesh is not None and v_down is not None:
                # down's basis spans the whole hidden space; this rank holds its rows for its hidden units, and
                # the projection (s u) V sums over all of them.
                v_rows = v_down.chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
                projected = _sum_over((s * u) @ v_rows, mesh)
                g_w_down = ((g_y.T @ projected) @ v_rows.T).to(w_down.dtype)
            else:
                g_w_down = _weight_grad(g_y, s * u, v_down).to(w_down.dtype)
            g_b_gate = g_a.sum(0).to(b_gate.dtype) if b_gate is not None and needs[8] else None
            g_b_up = g_u.sum(0).to(b_up.dtype) if b_up is not None and needs[9] else None
            g_b_down = g_y.sum(0).to(b_down.dtype) if b_down is not None and needs[10] else None
        by_param = dict(zip(map(id, trained), g_trained, strict=True))
        g_norm = [by_param.get(id(p)) for p in norm_params]
        grads = (g_w_gate, g_w_up, g_w_down, g_b_gate, g_b_up, g_b_down)
        return (g_h.to(h.dtype), None, None, None, None, *map(_like, grads, params), *g_norm)


def _sum_over(partial: torch.Tensor, mesh: Any) -> torch.Tensor:
    """The sum of ``partial`` over the ranks of the (1-D) tensor-parallel ``mesh``, in float32 at least."""
    import torch.distributed as dist

    total = partial.float() if partial.dtype in (torch.float16, torch.bfloat16) else partial.clone()
    dist.all_reduce(total, group=mesh.get_group())
    return total.to(partial.dtype)


def _like(grad: torch.Tensor | None, param: torch.Tensor | None) -> torch.Tensor | None:
    """``grad`` (this rank's part) as ``param`` is: a DTensor of its mesh and placements for a tensor-parallel one."""
    if grad is None or param is None or not hasattr(param, "device_mesh"):
        return grad
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The current autocast settings of ``device_type``, as ``torch.autocast`` keyword arguments."""
    return {
        "device_type": device_type,
        "dtype": torch.get_autocast_dtype(device_type),
        "enabled": torch.is_autocast_enabled(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }
