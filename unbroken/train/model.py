"""The LLaMA architecture as a pure ``nn.Module``: RMSNorm, RoPE, attention, SwiGLU and the stack.

Owns the modules and the weight init; the sizes (``ModelArgs``, ``FLAVOURS``) and the analytic
parameter and FLOP counts live in ``flavours.py`` (no torch) and are re-exported here. Parameter names
follow meta-llama/llama and torchtitan (``wq wk wv wo``, ``w1 w2 w3``, ``attention_norm``, ``ffn_norm``,
``tok_embeddings``, ``layers``, ``norm``, ``output``) so state dicts match theirs.

It must not know about training: no ``torch.distributed``, no optimizer, no device moves, no failure
logic. Training-time transforms wrap ``TransformerBlock.attention`` / ``.feed_forward`` from outside, so
``Attention.forward(x, freqs_cis)`` and ``FeedForward.forward(x)`` keep these signatures.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.core.flavours import FLAVOURS, ModelArgs, flops_per_token, model_args, num_params

__all__ = ["FLAVOURS", "ModelArgs", "flops_per_token", "model_args", "num_params", "Transformer"]


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 at least, whatever the activation dtype, as the reference does.
        xf = x.to(_at_least_fp32(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float = 10000.0, device: torch.device | None = None
) -> torch.Tensor:
    """RoPE rotation table for positions ``0..end-1``: shape (end, head_dim // 2, 2) holding (cos, sin).

    The real-valued equivalent of the reference's complex ``freqs_cis`` (``torch.polar(1, freqs)``).
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(end, device=device, dtype=torch.float32), freqs)  # (end, head_dim/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (x[2i], x[2i+1]) pairs of queries and keys by their position's angles.

    Shapes: ``xq`` (B, T, n_heads, head_dim), ``xk`` (B, T, n_kv_heads, head_dim),
    ``freqs_cis`` (T, head_dim/2, 2). Adjacent-pair layout, as the reference's
    ``view_as_complex(x.reshape(..., -1, 2))``.
    """
    cos = freqs_cis[None, :, None, :, 0]  # (1, T, 1, head_dim/2)
    sin = freqs_cis[None, :, None, :, 1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.to(_at_least_fp32(x.dtype)).reshape(*x.shape[:-1], -1, 2).unbind(-1)  # (B, T, H, head_dim/2)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, T, H, head_dim/2, 2)
        return out.flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, n_kv_heads, head_dim) -> (B, T, n_kv_heads * n_rep, head_dim), each kv head repeated."""
    if n_rep == 1:
        return x
    B, T, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(B, T, n_kv_heads, n_rep, head_dim).reshape(B, T, -1, head_dim)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, n_heads, head_dim)
        xk = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        xv = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xk = repeat_kv(xk, self.n_rep)  # (B, T, n_heads, head_dim)
        xv = repeat_kv(xv, self.n_rep)
        q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, n_heads, T, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_heads, T, head_dim)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, dim)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, hidden) -> (B, T, dim)

    def init_weights(self, init_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.w3.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.w2.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Residual-branch output projections (wo, w2) are scaled down with depth (torchtitan).
        self.init_std = 0.02 / math.sqrt(2 * args.n_layers)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)  # (B, T, dim)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    """The LLaMA decoder: token embedding, ``n_layers`` pre-norm blocks, final RMSNorm, untied output.

    Build under ``torch.device("meta")`` to get shapes and counts without memory; to materialise such a
    model, call ``to_empty(device=...)`` then ``init_weights()`` (which also refills the RoPE buffer).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so the state dict holds parameters only.
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta),
            persistent=False,
        )
        self.init_weights()

    def init_weights(self) -> None:
        """Re-initialise every weight from the global torch RNG (deterministic given ``torch.manual_seed``).

        Embeddings and linear weights ~ N(0, 0.02); ``wo`` and ``w2`` ~ N(0, 0.02 / sqrt(2 * n_layers));
        norm weights = 1. The constructor calls this once; the default inits of ``nn.Linear`` /
        ``nn.Embedding`` run before it and also draw from the RNG, so build the same way on every rank.
        """
        with torch.no_grad():
            self.freqs_cis.copy_(
                precompute_freqs_cis(
                    self.args.head_dim,
                    self.args.max_seq_len,
                    self.args.rope_theta,
                    device=self.freqs_cis.device,
                )
            )
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) in float32 (or wider, for a float64 model) for ``tokens`` (B, T) int64.

        Raises:
            ValueError: T exceeds ``args.max_seq_len``.
        """
        B, T = tokens.shape
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model max_seq_len = {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        freqs_cis = self.freqs_cis[:T]  # (T, head_dim/2, 2)
        for layer in self.layers:
            h = layer(h, freqs_cis)  # (B, T, dim)
        h = self.norm(h)
        logits = self.output(h)  # (B, T, vocab_size)
        return logits.to(_at_least_fp32(logits.dtype))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
