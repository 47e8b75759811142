"""Hugging Face LLaMA in the built-in trainer: building ``LlamaForCausalLM`` from a config, and export.

Owns ``[model] hf_config`` (a ``config.json`` path, or a packaged preset such as ``llama-tiny``), building the
model from it (no download: the weights are initialised from ``train.seed``), the plan tensor parallelism splits
it by (``tensor_plan``: its projections' names), and ``unbroken export RUN_DIR OUT``: the run's last checkpoint as
a ``save_pretrained`` folder with the run's tokenizer. A run of the built-in LLaMA exports too: its weights map
onto ``LlamaForCausalLM``'s, with the query and key rows of each head permuted from adjacent-pair RoPE (ours,
Meta's) to HF's rotate-half layout. ``transformers`` is imported only here, only when used (the ``hf`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unbroken.train.model import ModelArgs

if TYPE_CHECKING:
    from unbroken.ft import TensorParallelPlan

PRESETS = ("llama-tiny",)
# What a worker of the built-in trainer imports to build ``LlamaForCausalLM`` (1.3 s of CPU here): its agent's zygote
# imports it once, before forking the workers (``control.host.zygote``).
WORKER_IMPORTS = ("transformers.models.llama.modeling_llama",)


def worker_imports(hf_config: str) -> tuple[str, ...]:
    """The modules the trainer's workers import beyond the trainer's own for a run whose ``model.hf_config`` is this."""
    return WORKER_IMPORTS if hf_config else ()


def transformers_lib() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"model.hf_config needs the transformers package (pip install 'unbroken[hf]'): {e}") from None
    return transformers


def config_path(spec: str) -> Path:
    """The ``config.json`` that ``spec`` names: a path, or a packaged preset (``llama-tiny``)."""
    if spec in PRESETS:
        from unbroken.core.config import preset_path

        return preset_path(f"hf_{spec.replace('-', '_')}", ".json")
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"model.hf_config = {spec!r} is neither a config.json file nor a preset ({', '.join(PRESETS)})"
        )
    return path


def llama_config(spec: str, vocab_size: int, seq_len: int) -> Any:
    """The ``LlamaConfig`` of ``spec`` for this run: the tokenizer's vocabulary, room for ``seq_len``, no cache."""
    transformers = transformers_lib()
    try:
        config = transformers.LlamaConfig.from_json_file(str(config_path(spec)))
    except (OSError, ValueError) as e:
        raise ValueError(f"model.hf_config = {spec!r} is not a readable LlamaConfig JSON file ({e})") from None
    config.vocab_size = vocab_size
    config.max_position_embeddings = max(int(config.max_position_embeddings), seq_len)
    config.use_cache = False
    config.tie_word_embeddings = False
    return config


def build_hf_llama(spec: str, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """``LlamaForCausalLM`` from ``spec``, initialised from the global RNG (seed it first, on every worker)."""
    return transformers_lib().LlamaForCausalLM(llama_config(spec, vocab_size, seq_len))


def tensor_plan() -> TensorParallelPlan:
    """Which submodules of ``LlamaForCausalLM`` tensor parallelism splits (``ft.apply_tensor_parallel``): each
    decoder layer's attention and MLP projections. Its attention views them by -1 heads, so no head count changes
    with the split; sequence parallelism is not planned for it."""
    from unbroken.ft import TensorParallelPlan

    return TensorParallelPlan(
        layers="model.layers",
        attention="self_attn",
        qkv=("q_proj", "k_proj", "v_proj"),
        attn_out="o_proj",
        ffn="mlp",
        ffn_in=("gate_proj", "up_proj"),
        ffn_out="down_proj",
    )


def to_hf_state_dict(ours: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our LLaMA's state dict in ``LlamaForCausalLM``'s names and layout (the query/key rows of every head
    reordered from adjacent pairs (x0, x1), (x2, x3), ... to halves (x0, x2, ...), (x1, x3, ...))."""

    def halves(w: torch.Tensor, heads: int) -> torch.Tensor:
        hd = args.head_dim
        return w.view(heads, hd // 2, 2, -1).transpose(1, 2).reshape(heads * hd, -1)

    out = {
        "model.embed_tokens.weight": ours["tok_embeddings.weight"],
        "model.norm.weight": ours["norm.weight"],
        "lm_head.weight": ours["output.weight"],
    }
    for i in range(args.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = halves(ours[p + "attention.wq.weight"], args.n_heads)
        out[q + "self_attn.k_proj.weight"] = halves(ours[p + "attention.wk.weight"], args.n_kv_heads)
        out[q + "self_attn.v_proj.weight"] = ours[p + "attention.wv.weight"]
        out[q + "self_attn.o_proj.weight"] = ours[p + "attention.wo.weight"]
        out[q + "mlp.gate_proj.weight"] = ours[p + "feed_forward.w1.weight"]
        out[q + "mlp.up_proj.weight"] = ours[p + "feed_forward.w3.weight"]
        out[q + "mlp.down_proj.weight"] = ours[p + "feed_forward.w2.weight"]
        out[q + "input_layernorm.weight"] = ours[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = ours[p + "ffn_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config_of(args: ModelArgs) -> Any:
    """The ``LlamaConfig`` of our LLaMA's sizes."""
    return transformers_lib().LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=False,
        use_cache=False,
    )
