"""The built-in trainer: the LLaMA of ``model.py`` on ``unbroken.data``'s corpus, one loop on ``unbroken.ft``.

    unbroken train configs/default.toml --workers 4     # the launcher runs `python -m unbroken.train` 4 times

It is a user of the public API and nothing more (``unbroken.ft.__all__``, no private path into the library):
build the model and the optimizer, register them, and for each step compute this worker's microbatches,
commit, and now and then evaluate. Everything a failure brings (recovery, rejoin, resume, checkpoints,
metrics) happens inside ``ft``. ``validate_launch`` checks what the workers will need before the launcher
starts anything.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import unbroken.ft as ft
from unbroken.core.config import RunConfig, TrainConfig, replace, to_toml
from unbroken.core.flavours import flops_per_token, training_flops_per_token
from unbroken.data.corpus import (
    check_model_vocab,
    check_vocab,
    eval_sampler,
    is_prepared,
    open_corpus,
    text_vocab_size,
    tokenizer_sha256,
    train_sampler,
)
from unbroken.data.reader import PreparedCorpus
from unbroken.train.model import ModelArgs, Transformer, model_args
from unbroken.train.stages import pipeline_stage, stage_layers


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over the first ``warmup_fraction`` of the schedule's steps (``train.schedule_steps``, 0:
    ``train.steps``), then cosine to ``lr * min_lr_ratio``, held past the schedule's end (a run extended by
    ``--resume --train.steps=N`` keeps its schedule)."""
    length = cfg.schedule_length
    warmup = int(cfg.warmup_fraction * length)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, length - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights are not decayed): on a GPU the fused kernel (one
    launch for every parameter), on the CPU the per-parameter loop. The CPU's fused kernel is faster (the tiny
    model's step: 0.47 ms against 1.69 ms, one thread) but cannot serve every layout (below), and a layout that
    fell back to the loop would round otherwise than one that did not: exact mode's layouts must agree bit for
    bit. Nor does a GPU take the fused kernel where some parameters are DTensors and others plain tensors
    (tensor parallelism without FSDP: the norms are not split): no multi-tensor kernel takes a mix."""
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    on_gpu = all(p.device.type == "cuda" for p in params)
    one_kind = len({isinstance(p, DTensor) for p in params}) == 1
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
        fused=(on_gpu and one_kind) or None,
    )


def model_args_of(cfg: RunConfig, vocab_size: int) -> ModelArgs:
    """The built-in LLaMA's sizes for this run (the tokenizer's vocabulary unless model.vocab_size says more)."""
    return model_args(
        cfg.model.flavour,
        vocab_size=cfg.model.vocab_size or vocab_size,
        n_kv_heads=cfg.model.n_kv_heads,
        max_seq_len=cfg.data.seq_len,
    )


def build_model(cfg: RunConfig, vocab_size: int) -> torch.nn.Module:
    """The run's model (the built-in LLaMA, or Hugging Face's with ``model.hf_config``), initialised from
    ``train.seed`` (the same on every worker)."""
    torch.manual_seed(cfg.train.seed)
    if cfg.model.hf_config:
        from unbroken.train.hf import build_hf_llama

        return build_hf_llama(cfg.model.hf_config, cfg.model.vocab_size or vocab_size, cfg.data.seq_len)
    return Transformer(model_args_of(cfg, vocab_size))


def tensor_plan(cfg: RunConfig) -> ft.TensorParallelPlan:
    """Which submodules of the run's model tensor parallelism splits: the built-in LLaMA's (whole or a pipeline
    stage: the same names; its attention views its projections by its head counts, which the split divides), or
    with ``model.hf_config`` Hugging Face's ``LlamaForCausalLM``'s."""
    if cfg.model.hf_config:
        from unbroken.train.hf import tensor_plan as hf_tensor_plan

        return hf_tensor_plan()
    return ft.TensorParallelPlan(
        layers="layers",
        attention="attention",
        qkv=("wq", "wk", "wv"),
        attn_out="wo",
        ffn="feed_forward",
        ffn_in=("w1", "w3"),
        ffn_out="w2",
        head_counts=("n_heads", "n_kv_heads"),
        norms=("attention_norm", "ffn_norm"),
        ends=("tok_embeddings", "norm", "output"),
    )


def model_flops_per_token(cfg: RunConfig, vocab_size: int, model: torch.nn.Module) -> float:
    """The run's model's training FLOPs per token (``flavours.flops_per_token``: 6 N + 12 L d T, N without the
    input embedding); for a Hugging Face model N is counted from ``model`` (the whole model, before staging)."""
    if not cfg.model.hf_config:
        return flops_per_token(model_args_of(cfg, vocab_size), cfg.data.seq_len)
    hf = model.config
    embedding = model.get_input_embeddings().weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding
    return training_flops_per_token(non_embedding, hf.num_hidden_layers, hf.hidden_size, cfg.data.seq_len)


def logits_of(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return out if isinstance(out, torch.Tensor) else out.logits  # Hugging Face models return an output object


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def due(every: int, step: int, total: int) -> bool:
    return step + 1 == total or (every > 0 and (step + 1) % every == 0)


def main() -> int:
    """One worker of ``unbroken train``: the loop."""
    ctx = ft.init()
    cfg = ctx.config
    corpus = open_corpus(cfg.data)
    device = ctx.device
    model = build_model(cfg, corpus.vocab_size)  # built on the CPU: the same weights on every worker
    flops = model_flops_per_token(cfg, corpus.vocab_size, model)
    if ctx.stages > 1:
        model = pipeline_stage(model, ctx.stage, ctx.stages)  # this rank's part of the model
    model = model.to(device)
    if cfg.parallel.tensor > 1:
        # split inside the replica
        ft.apply_tensor_parallel(model, ctx.mesh["tensor"], tensor_plan(cfg), cfg.parallel.sequence_parallel)
    if cfg.parallel.shard > 1:
        ft.apply_fsdp(model, ctx.mesh["shard"])  # sharded over the replica's ranks (HSDP: replicated across replicas)
    optimizer = build_optimizer(model, cfg.train)
    ctx.register_state(
        model,
        optimizer,
        metadata={
            "config": to_toml(cfg),
            "model": cfg.model.hf_config or cfg.model.flavour,
            "vocab_size": corpus.vocab_size,
            "tokenizer_sha256": tokenizer_sha256(corpus),
        },
        flops_per_token=flops,
    )
    d, tc = cfg.data, cfg.train
    train = train_sampler(corpus, d, tc.microbatches, tc.seed)
    val = eval_sampler(corpus, d, tc.eval_microbatches)

    def val_batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return val.microbatch(k)

    @torch.no_grad()
    def val_loss(k: int) -> float:
        inputs, targets = (t.to(device) for t in val.microbatch(k))
        model.eval()
        with ctx.autocast():
            loss = float(cross_entropy(logits_of(model, inputs), targets))
        model.train()
        return loss

    for step in ctx.steps(tc.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step.index, tc)
        if ctx.stages > 1:
            step.pipeline(lambda j, s=step.index: train.microbatch(s, j), cross_entropy)
        else:
            for mb in step.microbatches():
                inputs, targets = (t.to(device) for t in train.microbatch(step.index, mb))
                with ctx.autocast():
                    loss = cross_entropy(logits_of(model, inputs), targets)
                step.backward(loss, tokens=inputs.numel(), inputs=(inputs, targets))  # the data check's too
        step.commit(optimizer, clip_grad_norm=tc.grad_clip)
        if due(tc.eval_every, step.index, tc.steps):  # each records the step's validation loss
            if ctx.stages > 1:
                ctx.evaluate_pipeline(tc.eval_microbatches, val_batch, cross_entropy)
            else:
                ctx.evaluate(tc.eval_microbatches, val_loss)
    return 0


def validate_launch(cfg: RunConfig, run_dir: Path, resume: bool) -> RunConfig:
    """What the workers will need, checked before anything starts: the data (tokenized into the cache here,
    once; prepared data: every checksum unless ``data.verify`` is off), the vocabulary, and for ``--resume`` a
    checkpoint that verifies and fits this model and data; the device, and a C++ compiler for ``train.compile``
    on the CPU. ValueError (one line) otherwise. Returns the config the run records: for prepared data,
    ``data.vocab_size`` is the data's vocabulary (it trains no BPE; the key would otherwise show the default)."""
    if ft.check_device(str(cfg.train.device), str(cfg.comm.backend)) == "cpu" and cfg.train.compile:
        ft.check_compiler()
    # Text is tokenized below (slow), so a vocabulary that cannot fit is refused first; prepared data's
    # vocabulary and tokenizer are checked when it is opened.
    vocab = text_vocab_size(cfg.data) if cfg.model.vocab_size else None
    if vocab is not None:
        check_model_vocab(vocab, cfg.model.vocab_size)
    corpus = open_corpus(cfg.data, verify=cfg.data.verify)
    check_vocab(corpus, cfg.model.vocab_size)
    if cfg.model.hf_config:
        from unbroken.train.hf import llama_config

        llama_config(cfg.model.hf_config, corpus.vocab_size, cfg.data.seq_len)  # else every worker dies of it
    if cfg.parallel.pipeline > 1:
        if cfg.model.hf_config:
            raise ValueError("parallel.pipeline > 1 cuts the built-in LLaMA into stages; model.hf_config is not one")
        stage_layers(model_args_of(cfg, corpus.vocab_size).n_layers, 0, cfg.parallel.pipeline)
    if cfg.parallel.tensor > 1:
        with torch.device("meta"):  # the shapes only
            whole = build_model(cfg, corpus.vocab_size)
        staged = pipeline_stage(whole, 0, cfg.parallel.pipeline) if cfg.parallel.pipeline > 1 else whole
        ft.check_tensor_parallel(staged, cfg.parallel.tensor, tensor_plan(cfg), cfg.parallel.sequence_parallel)
    if resume:
        check_resumable(cfg, run_dir, corpus)
    if is_prepared(cfg.data) and 256 <= corpus.vocab_size <= 2**20:  # DataConfig's range
        cfg = replace(cfg, data=replace(cfg.data, vocab_size=corpus.vocab_size))
    return cfg


def check_resumable(cfg: RunConfig, run_dir: Path, corpus: PreparedCorpus) -> None:
    """ValueError (one line) unless RUN_DIR has a checkpoint that verifies and fits this model and data."""
    loaded = ft.load_latest(run_dir, log_rejections=False)  # the workers report rejections in the metrics
    if loaded is None:
        rejected = ft.list_checkpoints(run_dir)
        if not rejected:
            raise ValueError(
                f"--resume {run_dir}: no checkpoint in {ft.checkpoint_dir(run_dir)} "
                "(the run stopped before its first one); start the run again"
            )
        raise ValueError(
            f"--resume {run_dir}: none of the {len(rejected)} checkpoints is usable "
            f"(newest: step {rejected[0]} is damaged or incomplete); the files are left as they are"
        )
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_model(cfg, corpus.vocab_size).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in loaded.state["model"].items()}
    if found != expected:
        diff = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        first = diff[0] if diff else "model"
        raise ValueError(
            f"--resume {run_dir}: checkpoint step {loaded.step} is for a different model shape "
            f"({first}: checkpoint {found.get(first)}, config {expected.get(first)}); resume with the run's own config"
        )
    if cfg.parallel.shard * cfg.parallel.pipeline * cfg.parallel.tensor > 1 and not loaded.sharded:
        raise ValueError(
            f"--resume {run_dir}: checkpoint step {loaded.step} was written by replicas of one rank (one file); "
            "replicas of several ranks resume from a sharded checkpoint only; resume with parallel.shard = "
            "parallel.pipeline = parallel.tensor = 1"
        )
    saved_sha = loaded.state["metadata"].get("tokenizer_sha256")
    if saved_sha is not None and saved_sha != tokenizer_sha256(corpus):
        raise ValueError(
            f"--resume {run_dir}: checkpoint step {loaded.step} was trained with another tokenizer "
            f"(sha256 {saved_sha[:12]}, the data now uses {tokenizer_sha256(corpus)[:12]}); resume with the run's "
            "own data settings"
        )
