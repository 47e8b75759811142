"""A Hugging Face LlamaForCausalLM (built from a small config, no download) under unbroken.ft.

    unbroken launch --workers 4 examples/hf_llama.py                                  # ReCoVer
    unbroken launch --workers 4 --recovery.policy=mecefo examples/hf_llama.py        # MeCeFO's efficient backward
    unbroken launch --workers 4 --recovery.reduction=exact \
        --failures.schedule="kill:worker=2,step=6,phase=backward,rejoin=2" examples/hf_llama.py

The model is the user's; the library applies MeCeFO's transform to its decoder layers when the policy asks
for it (register_state). Tokens are synthetic: a pure function of (seed, step, microbatch id).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import unbroken.ft as ft

CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)


def batch_for(seed: int, step: int, microbatch: int) -> torch.Tensor:
    """4 sequences of 48 tokens drawn from a fixed bigram table, so there is something to learn."""
    table = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, CONFIG.vocab_size, (CONFIG.vocab_size, 4), generator=table)
    g = ft.generator(seed, step, microbatch)  # the same on every worker
    tokens = [torch.randint(0, CONFIG.vocab_size, (4,), generator=g)]
    for _ in range(47):
        choice = torch.randint(0, 4, (4,), generator=g)
        tokens.append(successors[tokens[-1], choice])
    return torch.stack(tokens, dim=1)


def main() -> None:
    ctx = ft.init()
    seed = ctx.config.train.seed
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    ctx.register_state(model, optimizer)
    for step in ctx.steps():
        for mb in step.microbatches():
            tokens = batch_for(seed, step.index, mb)
            step.backward(model(input_ids=tokens, labels=tokens).loss, tokens=tokens.numel(), inputs=tokens)
        result = step.commit(optimizer, clip_grad_norm=1.0)
        if ctx.rank == 0 and step.index % 10 == 0:
            print(f"step {step.index}: loss {result.loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
