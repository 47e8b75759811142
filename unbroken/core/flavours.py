"""Model sizes without torch: ``ModelArgs``, the named ``FLAVOURS``, and analytic parameter and FLOP counts.

Owns the arithmetic of the LLaMA sizes so that the cluster simulator and the cost model can use them
without importing torch; ``model.py`` builds the modules from these arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int  # model width
    n_layers: int
    n_heads: int  # query heads; head_dim = dim // n_heads
    n_kv_heads: int  # key/value heads; < n_heads is grouped-query attention
    vocab_size: int
    ffn_hidden: int  # SwiGLU hidden width
    max_seq_len: int  # longest sequence forward accepts (size of the RoPE table)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} = {getattr(self, name)} must be >= 1")
        for name in ("norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model {name} = {getattr(self, name)} must be > 0")
        if self.dim % self.n_heads:
            raise ValueError(f"model dim = {self.dim} must be divisible by n_heads = {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model n_heads = {self.n_heads} must be divisible by n_kv_heads = {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Paper sizes follow the GaLore / ReLoRA LLaMA configs (vocab 32000, sequence length 256).
FLAVOURS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden=352, max_seq_len=128),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=8192, ffn_hidden=704, max_seq_len=256),
    "60m": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=32000, ffn_hidden=1376, max_seq_len=256),
    "130m": ModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, ffn_hidden=2048, max_seq_len=256
    ),
    "350m": ModelArgs(
        dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=32000, ffn_hidden=2736, max_seq_len=256
    ),
    "1b": ModelArgs(
        dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_hidden=5461, max_seq_len=256
    ),
    "7b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_hidden=11008, max_seq_len=256
    ),
}


def model_args(flavour: str, vocab_size: int = 0, n_kv_heads: int = 0, max_seq_len: int = 0) -> ModelArgs:
    """The flavour's args, with ``vocab_size`` / ``n_kv_heads`` / ``max_seq_len`` replaced when nonzero.

    Raises:
        ValueError: unknown flavour, or the replaced values make invalid args.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"model flavour {flavour!r} is unknown; allowed: {', '.join(FLAVOURS)}")
    overrides = {"vocab_size": vocab_size, "n_kv_heads": n_kv_heads, "max_seq_len": max_seq_len}
    return dataclasses.replace(FLAVOURS[flavour], **{k: v for k, v in overrides.items() if v})


def num_params(args: ModelArgs) -> int:
    """Exact parameter count of ``Transformer(args)``, computed without building it."""
    kv_dim = args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim  # wq, wo + wk, wv
    feed_forward = 3 * args.dim * args.ffn_hidden
    block = attention + feed_forward + 2 * args.dim  # + attention_norm, ffn_norm
    # tok_embeddings and output are separate (untied) vocab x dim matrices.
    return 2 * args.vocab_size * args.dim + args.n_layers * block + args.dim


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    The standard estimate ``6 * N + 12 * n_layers * dim * seq_len`` (Kaplan et al., PaLM appendix B):
    N counts every parameter except the embedding lookup, so the output matmul is included; the second
    term is the QK^T and attention-times-V matmuls, which have no parameters.
    """
    non_embedding = num_params(args) - args.vocab_size * args.dim
    return training_flops_per_token(non_embedding, args.n_layers, args.dim, seq_len)


def training_flops_per_token(non_embedding_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """``6 * N + 12 * n_layers * dim * seq_len`` for any decoder of ``n_layers`` blocks of width ``dim`` with N
    parameters besides its input embedding (``flops_per_token``)."""
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} must be >= 1")
    return float(6 * non_embedding_params + 12 * n_layers * dim * seq_len)
