"""Benchmarks of MeCeFO's efficient mode (``unbroken.ft.mecefo``) on one process, no collectives.

``bench_microbatch``: one efficient microbatch against one exact microbatch (forward, loss, backward) on
the same model and tokens: wall time (alternating exact / efficient after warm-up) and activation
memory, i.e. the bytes of unique storages that autograd saves for backward (parameters and buffers
excluded), in total and inside the transformer blocks; with the analytic expectation of both ratios
(``expected_ratios``).

``gradient_errors``: the relative error of the efficient microbatch's gradient against the exact one for
several ranks r, to choose ``efficient.DEFAULT_RANK``.

``basis_errors``: the FFN weight-gradient projection error with the randomized bases the handle computes
(``efficient.randomized_basis``) against the full SVD's, per rank, oversampling and power iterations, to
choose ``efficient.DEFAULT_OVERSAMPLE`` and ``DEFAULT_POWER_ITERS``. ``bench_refresh``: the time to compute
one weight's basis (default 4096 x 11008, LLaMA-7B's FFN down projection), randomized on any device, or
the float64 full SVD on the CPU that earlier versions used (``method="svd"``).

Data: real token windows of the embedded Shakespeare corpus (``data.corpus.open_corpus``; its cache is built on
first use), or random tokens with ``data="random"``. ``python -m unbroken.lab.bench_mecefo`` prints both;
``--dry-run`` checks its arguments and says in one line what it would run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from unbroken.core.config import DataConfig
from unbroken.core.failures import build_schedule
from unbroken.core.flavours import FLAVOURS
from unbroken.core.plan import mecefo_plan
from unbroken.data.corpus import check_vocab, open_corpus, train_sampler
from unbroken.ft.mecefo import (
    DEFAULT_OVERSAMPLE,
    DEFAULT_POWER_ITERS,
    DEFAULT_RANK,
    EfficientBackward,
    EfficientConfig,
    apply_efficient_backward,
    basis_seed,
    randomized_basis,
)
from unbroken.train.model import ModelArgs, Transformer, model_args

FULL_RANK = 1 << 30  # a rank above every width: exact FFN weight gradients


def expected_ratios(args: ModelArgs, seq_len: int, batch: int, rank: int) -> dict[str, float]:
    """Analytic efficient / exact ratios of FLOPs and saved activation memory for one microbatch.

    FLOPs, matmuls only, per token (d = dim, f = FFN hidden, kv = kv width, T = seq_len, V = vocab,
    L = layers, N = tokens of the microbatch):
    attention forward A = 2d(2d + 2kv) + 4Td (projections, QK^T and PV unmasked as in ``flops_per_token``),
    FFN forward M = 6df, head forward O = 2dV. Exact = 3 (L(A + M) + O) (backward = 2x forward).
    Efficient = forward L(A + M) + O, head backward 2O, and per layer no attention backward but the FFN
    recompute of gate and up (4df), its input gradients (6df) and the weight gradients, per matrix
    (out m, in n) 2rn + 2rm + 2rmn/N instead of 2mn (exact when r >= n).

    Saved activations, floats per token, counted from the ops of ``model.py`` in float32 (SDPA on CPU keeps
    q, k, v, its output and a logsumexp per head; RoPE multiplies by buffers, so it keeps nothing of its
    own): exact block = attention_norm (its input, normalised value and output: 3d, + 1 rsqrt) + q, k, v
    after RoPE and ``repeat_kv`` (3d) + the SDPA output (d, a view of which feeds wo) + heads + ffn_norm (3d + 1) +
    FFN (gate, up, activation, product: 4f); efficient block = the FFN sub-block input (d). The head,
    the same in both modes: final norm (3d + 1) and the log-softmax of the logits (V).
    """
    d, f, n_layers, vocab = args.dim, args.ffn_hidden, args.n_layers, args.vocab_size
    kv = args.n_kv_heads * args.head_dim
    tokens = seq_len * batch
    attention = 2 * d * (2 * d + 2 * kv) + 4 * seq_len * d
    ffn = 6 * d * f
    head = 2 * d * vocab

    def wgrad(m: int, n: int) -> float:
        return 2 * m * n if rank >= n else 2 * rank * n + 2 * rank * m + 2 * rank * m * n / tokens

    exact_flops = 3 * (n_layers * (attention + ffn) + head)
    efficient_flops = (
        n_layers * (attention + ffn) + 3 * head + n_layers * (4 * d * f + 6 * d * f + 2 * wgrad(f, d) + wgrad(d, f))
    )
    exact_block = (3 * d + 1) + 3 * d + d + args.n_heads + (3 * d + 1) + 4 * f
    efficient_block = d
    head_memory = 3 * d + 1 + vocab
    return {
        "flops": efficient_flops / exact_flops,
        "memory": (n_layers * efficient_block + head_memory) / (n_layers * exact_block + head_memory),
        "block_memory": efficient_block / exact_block,
        "exact_block_floats_per_token": float(exact_block),
        "head_floats_per_token": float(head_memory),
    }


def bench_microbatch(
    flavour: str = "small",
    seq_len: int = 128,
    batch: int = 4,
    rank: int = DEFAULT_RANK,
    repeats: int = 9,
    warmup: int = 2,
    seed: int = 0,
    data: str = "shakespeare",
    device: str = "cpu",
    autocast: bool = False,
) -> dict[str, float | int | str]:
    """Time and activation memory of one efficient microbatch against one exact microbatch.

    Returns times in ms (median, min, max over ``repeats``), saved activation bytes (total and inside the
    blocks) and the measured and expected (``expected_ratios``, float32) efficient / exact ratios; on CUDA
    also the peak memory allocated above the model during one microbatch (``*_peak_bytes``). ``autocast``:
    forwards under ``torch.autocast(device type, bfloat16)`` (the saved bytes then include the bfloat16
    weight copies autocast keeps for the backward).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats = {repeats} must be >= 1 and warmup = {warmup} >= 0")
    args = model_args(flavour, max_seq_len=max(seq_len, model_args(flavour).max_seq_len))
    torch.manual_seed(seed)
    model = Transformer(args).to(device)
    eb = apply_efficient_backward(model, EfficientConfig(rank=rank))
    eb.refresh(0)
    eb.wait()  # the bases are computed before timing: their cost is bench_refresh's
    x, y = (t.to(device) for t in _microbatch(args, seq_len, batch, seed, data))
    cuda = x.is_cuda
    precision = torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast)

    def step(efficient: bool) -> float:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        with eb.enabled(efficient), precision:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        if cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(warmup + repeats):
        for efficient in (False, True) if i % 2 == 0 else (True, False):
            seconds = step(efficient)
            if i >= warmup:
                times[efficient].append(seconds * 1e3)
    with precision:
        memory = {efficient: _saved_bytes(model, eb, efficient, x, y) for efficient in (False, True)}
    expected = expected_ratios(args, seq_len, batch, rank)
    result: dict[str, float | int | str] = {"flavour": flavour, "seq_len": seq_len, "batch": batch, "rank": rank}
    result["data"] = data
    result["device"] = str(x.device)
    result["autocast"] = "bfloat16" if autocast else "off"
    result["threads"] = torch.get_num_threads()
    if cuda:
        for efficient, name in ((False, "exact"), (True, "efficient")):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(x.device)
            base = torch.cuda.memory_allocated(x.device)
            torch.cuda.reset_peak_memory_stats(x.device)
            step(efficient)
            result[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated(x.device) - base
    for efficient, name in ((False, "exact"), (True, "efficient")):
        ms = times[efficient]
        result.update({f"{name}_ms": statistics.median(ms), f"{name}_ms_min": min(ms), f"{name}_ms_max": max(ms)})
        result[f"{name}_saved_bytes"], result[f"{name}_block_saved_bytes"] = memory[efficient]
    result["time_ratio"] = result["efficient_ms"] / result["exact_ms"]
    result["memory_ratio"] = result["efficient_saved_bytes"] / result["exact_saved_bytes"]
    result["block_memory_ratio"] = result["efficient_block_saved_bytes"] / result["exact_block_saved_bytes"]
    result["expected_flops_ratio"] = expected["flops"]
    result["expected_memory_ratio"] = expected["memory"]
    result["expected_block_memory_ratio"] = expected["block_memory"]
    return result


def gradient_errors(
    flavour: str = "small",
    seq_len: int = 128,
    batch: int = 4,
    ranks: tuple[int, ...] = (8, 16, 32, 64, 128, FULL_RANK),
    train_steps: int = 300,
    microbatches: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
    data: str = "shakespeare",
) -> list[dict[str, float | int]]:
    """Relative gradient errors ||g~ - g|| / ||g|| of an efficient microbatch, per rank.

    The model is first trained ``train_steps`` exact AdamW steps (constant ``lr``, weight decay 0.01,
    clip 1.0) on one microbatch per step; the errors are then averaged over the next ``microbatches``
    microbatches, each compared with its own exact gradient. Per rank: ``ffn_projection`` (FFN weights,
    g~ at rank r against g~ at full rank: the projection alone), ``ffn`` (FFN weights against the exact
    microbatch), ``model`` (every parameter but the attention ones, which efficient mode leaves out)
    and ``model_with_attention`` (attention gradients counted as zero).
    """
    model, measured = _trained(flavour, seq_len, batch, train_steps, microbatches, lr, seed, data)
    names = [n for n, _ in model.named_parameters()]

    def grads(eb: EfficientBackward | None) -> list[dict[str, torch.Tensor]]:
        out = []
        for x, y in measured:
            model.zero_grad(set_to_none=True)
            with eb.enabled() if eb is not None else nullcontext():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            out.append(
                {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            )
        return out

    def error(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]], keep: Callable[[str], bool]) -> float:
        kept = [n for n in names if keep(n)]
        errors = [
            math.sqrt(sum(float((ga[n] - gb[n]).square().sum()) for n in kept))
            / math.sqrt(sum(float(gb[n].square().sum()) for n in kept))
            for ga, gb in zip(a, b, strict=True)
        ]
        return statistics.mean(errors)

    exact = grads(None)
    per_rank = {}
    for r in sorted(set(ranks) | {FULL_RANK}):
        eb = apply_efficient_backward(model, EfficientConfig(rank=r))
        per_rank[r] = grads(eb)
        attention = {id(p) for p in eb.attention_parameters()}
        eb.remove()
    is_attention = {n: id(p) in attention for n, p in model.named_parameters()}

    def is_ffn(n: str) -> bool:
        return ".feed_forward." in n

    return [
        {
            "rank": r,
            "ffn_projection": error(per_rank[r], per_rank[FULL_RANK], is_ffn),
            "ffn": error(per_rank[r], exact, is_ffn),
            "model": error(per_rank[r], exact, lambda n: not is_attention[n]),
            "model_with_attention": error(per_rank[r], exact, lambda n: True),
        }
        for r in ranks
    ]


def basis_errors(
    flavour: str = "small",
    seq_len: int = 128,
    batch: int = 4,
    ranks: tuple[int, ...] = (8, 16, 32, 64, 128),
    oversamples: tuple[int, ...] = (0, 8, 16, 32),
    power_iters: tuple[int, ...] = (0, 1, 2, 4),
    train_steps: int = 300,
    microbatches: int = 4,
    lr: float = 3e-3,
    seed: int = 0,
    data: str = "shakespeare",
) -> list[dict[str, float | int]]:
    """The FFN weight-gradient projection error of randomized bases against the full SVD's.

    The model is trained as in ``gradient_errors``; G is each measured microbatch's efficient FFN weight
    gradient at full rank (what the projection acts on). For a basis V of every FFN weight, the error is
    e(V) = ||G - G V V^T|| / ||G|| (Frobenius over all FFN weights together, mean over the microbatches), the
    quantity ``gradient_errors`` reports as ``ffn_projection``. Per rank r: ``svd`` (V from a float64 full
    SVD) and, per oversampling p and power iterations q, ``randomized`` (V from ``randomized_basis``, seeded
    as the handle seeds them at step 0), ``excess`` = randomized - svd, and ``sin_max``, the largest sine of
    a principal angle between the two subspaces over all weights (1: some direction of one is orthogonal
    to the other).
    """
    model, measured = _trained(flavour, seq_len, batch, train_steps, microbatches, lr, seed, data)
    eb = apply_efficient_backward(model, EfficientConfig(rank=FULL_RANK))
    ffn = [(i, k, linear) for i, block in enumerate(model.layers) for k, linear in enumerate(_ffn_linears(block))]
    grads = []
    for x, y in measured:
        model.zero_grad(set_to_none=True)
        with eb.enabled():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads.append([linear.weight.grad.detach().double().clone() for _, _, linear in ffn])
    eb.remove()
    exact = [torch.linalg.svd(linear.weight.detach().double(), full_matrices=False)[2] for _, _, linear in ffn]

    def error(bases: list[torch.Tensor | None]) -> float:
        errors = []
        for gs in grads:
            residual = sum(
                float((g - g @ v @ v.T).square().sum()) for g, v in zip(gs, bases, strict=True) if v is not None
            )
            errors.append(math.sqrt(residual / sum(float(g.square().sum()) for g in gs)))
        return statistics.mean(errors)

    rows: list[dict[str, float | int]] = []
    for r in ranks:
        svd = [vh[: min(r, vh.shape[0])].T if r < vh.shape[1] else None for vh in exact]
        e_svd = error(svd)
        for p in oversamples:
            for q in power_iters:
                bases = [
                    None
                    if v is None
                    else randomized_basis(linear.weight, r, p, q, basis_seed(0, f"layers.{i}", k)).double()
                    for (i, k, linear), v in zip(ffn, svd, strict=True)
                ]
                e = error(bases)
                sin_max = max(
                    (
                        float(torch.linalg.matrix_norm(a - b @ (b.T @ a), ord=2))
                        for a, b in zip(svd, bases, strict=True)
                        if a is not None
                    ),
                    default=0.0,
                )
                rows.append(
                    {
                        "rank": r,
                        "oversample": p,
                        "power_iters": q,
                        "svd": e_svd,
                        "randomized": e,
                        "excess": e - e_svd,
                        "sin_max": sin_max,
                    }
                )
    return rows


def bench_refresh(
    out_features: int = 4096,
    in_features: int = 11008,
    rank: int = DEFAULT_RANK,
    oversample: int = DEFAULT_OVERSAMPLE,
    power_iters: int = DEFAULT_POWER_ITERS,
    method: str = "randomized",
    device: str = "cpu",
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, float | int | str]:
    """Seconds to compute one (out_features x in_features) weight's basis: median, min and max of ``repeats``.

    ``method``: ``randomized`` (``efficient.randomized_basis`` in float32 on ``device``, after one untimed
    warm-up call) or ``svd`` (the float64 full ``torch.linalg.svd`` on the CPU with one intra-op thread, as
    earlier versions computed every basis; no warm-up). The weight is Gaussian with std 1/sqrt(in_features).
    """
    if method not in ("randomized", "svd"):
        raise ValueError(f'method = {method!r} must be "randomized" or "svd"')
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)).to(device)

    def once() -> float:
        start = time.perf_counter()
        if method == "randomized":
            randomized_basis(w, rank, oversample, power_iters, seed)
            if w.is_cuda:
                torch.cuda.synchronize(w.device)
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                torch.linalg.svd(w.cpu().double(), full_matrices=False)
            finally:
                torch.set_num_threads(threads)
        return time.perf_counter() - start

    if method == "randomized":
        once()
    times = [once() for _ in range(repeats)]
    return {
        "shape": f"{out_features} x {in_features}",
        "rank": rank,
        "oversample": oversample,
        "power_iters": power_iters,
        "method": method,
        "device": str(w.device),
        "threads": 1 if method == "svd" else torch.get_num_threads(),
        "repeats": repeats,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
    }


def scenario_membership(scenario: str, workers: int, steps: int, run_hours: float, seed: int) -> list[tuple[int, ...]]:
    """The alive workers at each step under MeCeFO's ``scenario``, by the launcher's own rule and generator
    (``failures.build_schedule`` at one second per step): a kill at step s takes its victim out from s, and it
    is back ``rejoin`` steps later."""
    schedule = build_schedule("", 0.0, 0.0, seed, 1.0, workers, steps, scenario, run_hours)
    down = [set() for _ in range(steps)]
    for e in schedule.events:
        back = steps if e.rejoin_after_s is None else min(steps, e.step + max(1, math.ceil(e.rejoin_after_s)))
        for s in range(e.step, back):
            down[s].add(e.worker)
    return [tuple(w for w in range(workers) if w not in down[s]) for s in range(steps)]


def gradient_error_run(
    flavour: str = "small",
    seq_len: int = 128,
    batch: int = 4,
    microbatches: int = 8,
    workers: int = 4,
    steps: int = 200,
    scenario: str = "high",
    run_hours: float = 64.0,
    rank: int = DEFAULT_RANK,
    refresh_every: int = 100,
    spread: bool = False,
    lr: float = 3e-3,
    seed: int = 0,
    data: str = "shakespeare",
) -> dict[str, object]:
    """The relative error ||g~ - g|| / ||g|| of MeCeFO's step gradient over a whole run, in one process.

    The run follows MeCeFO's trajectory: at each step the real planner (``plan.mecefo_plan``) says which of
    the M microbatches run in efficient mode given the scenario's membership; the committed gradient g~
    sums exact and efficient microbatch gradients with attention normalised by the exact ones, as the
    trainer does, and AdamW (clip 1.0) steps with it. On each step with a failure, g (every microbatch
    exact) is computed too. Reported per failure step: the step error (all parameters), the error without
    the attention parameters, and the mean per-microbatch error of the efficient microbatches alone (the
    neighbour's own estimate, the quantity closest to the paper's Assumption 3).
    """
    args = model_args(flavour, max_seq_len=max(seq_len, model_args(flavour).max_seq_len))
    torch.manual_seed(seed)
    model = Transformer(args)
    eb = apply_efficient_backward(model, EfficientConfig(rank=rank, refresh_every=refresh_every))
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=lr, weight_decay=0.01)
    data_cfg = DataConfig(seq_len=seq_len, microbatch_size=batch)
    corpus = None if data == "random" else open_corpus(data_cfg)
    if corpus is not None:
        check_vocab(corpus, args.vocab_size)
    sampler = train_sampler(corpus, data_cfg, microbatches, seed) if corpus is not None else None
    run = _ErrorRun(model, eb, microbatches, sampler, (seed, args.vocab_size, batch, seq_len))
    ring = list(range(workers))
    rows = []
    for step, alive in enumerate(scenario_membership(scenario, workers, steps, run_hours, seed)):
        efficient = mecefo_plan(step, ring, alive, microbatches, spread=spread).efficient
        eb.refresh(step, needed=bool(efficient))  # as the protocol calls it: bases only in windows with failures
        approx, row = run.step(step, efficient)
        if row is not None:
            rows.append({"step": step, "alive": len(alive), **row})
        for p, g in zip(run.params, approx, strict=True):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(run.params, 1.0)
        optimizer.step()
    return {
        "flavour": flavour,
        "scenario": scenario,
        "steps": steps,
        "workers": workers,
        "microbatches": microbatches,
        "rank": rank,
        "spread": spread,
        "failure_steps": rows,
    }


class _ErrorRun:
    """``gradient_error_run``'s model and data: each microbatch's gradient, exact or efficient, and a step's
    committed gradient with (on a failure step) its errors against the exact one."""

    def __init__(
        self,
        model: Transformer,
        eb: EfficientBackward,
        microbatches: int,
        sampler: Any,
        random: tuple[int, int, int, int],
    ) -> None:
        self.model, self.eb, self.M, self.sampler = model, eb, microbatches, sampler
        self.seed, self.vocab, self.batch, self.seq_len = random  # the random data's, without a sampler
        self.params = list(model.parameters())
        attention = {id(p) for p in eb.attention_parameters()}
        self.attention = [id(p) in attention for p in self.params]
        self.every = [True] * len(self.params)
        self.no_attention = [not a for a in self.attention]

    def tokens(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sampler is not None:
            return self.sampler.microbatch(step, j)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * self.M + j)
        t = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=gen)
        return t[:, :-1], t[:, 1:]

    def grad_of(self, step: int, j: int, efficient: bool) -> list[torch.Tensor]:
        self.model.zero_grad(set_to_none=True)
        x, y = self.tokens(step, j)
        with self.eb.enabled(efficient):
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()) / self.M
        loss.backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params]

    @staticmethod
    def norm(tensors: list[torch.Tensor], keep: list[bool]) -> float:
        return math.sqrt(sum(float(t.square().sum()) for t, k in zip(tensors, keep, strict=True) if k))

    def step(self, step: int, efficient: Collection[int]) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
        """The committed gradient g~ of ``step`` (``efficient``: the ids in efficient mode), and on a failure step
        its errors against g (every microbatch exact): all parameters, without attention, per microbatch."""
        approx = [torch.zeros_like(p) for p in self.params]
        exact = [torch.zeros_like(p) for p in self.params] if efficient else None
        per_microbatch = []
        for j in range(self.M):
            g = self.grad_of(step, j, False) if (exact is not None or j not in efficient) else None
            if exact is not None:
                torch._foreach_add_(exact, g)
            if j in efficient:
                g_eff = self.grad_of(step, j, True)
                error = self.norm(torch._foreach_sub(g_eff, g), self.no_attention) / self.norm(g, self.no_attention)
                per_microbatch.append(error)
                torch._foreach_add_(approx, g_eff)
            else:
                torch._foreach_add_(approx, g)
        if exact is None:
            return approx, None
        contributed = self.M - len(efficient)
        for t, is_attention in zip(approx, self.attention, strict=True):
            if is_attention:
                t.mul_(self.M / contributed if contributed else 0.0)
        diff = torch._foreach_sub(approx, exact)
        return approx, {
            "efficient": len(efficient),
            "error": self.norm(diff, self.every) / self.norm(exact, self.every),
            "error_without_attention": self.norm(diff, self.no_attention) / self.norm(exact, self.no_attention),
            "microbatch_error": statistics.mean(per_microbatch),
        }


def _trained(
    flavour: str, seq_len: int, batch: int, train_steps: int, microbatches: int, lr: float, seed: int, data: str
) -> tuple[Transformer, list[tuple[torch.Tensor, ...]]]:
    """A model trained ``train_steps`` exact AdamW steps (constant ``lr``, weight decay 0.01, clip 1.0), one
    microbatch per step, and the next ``microbatches`` microbatches."""
    args = model_args(flavour, max_seq_len=max(seq_len, model_args(flavour).max_seq_len))
    torch.manual_seed(seed)
    model = Transformer(args)
    batches = _batches(args, seq_len, batch, seed, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for _ in range(train_steps):
        x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model, [next(batches) for _ in range(microbatches)]


def _ffn_linears(block: torch.nn.Module) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear]:
    ff = block.feed_forward
    return ff.w1, ff.w3, ff.w2  # gate, up, down: the handle's order


def _batches(args: ModelArgs, seq_len: int, batch: int, seed: int, data: str) -> Iterator[tuple[torch.Tensor, ...]]:
    if data == "random":
        gen = torch.Generator().manual_seed(seed)
        while True:
            tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=gen)
            yield tokens[:, :-1], tokens[:, 1:]
    if data != "shakespeare":
        raise ValueError(f'data = {data!r} must be "shakespeare" or "random"')
    data_cfg = DataConfig(seq_len=seq_len, microbatch_size=batch)
    corpus = open_corpus(data_cfg)
    check_vocab(corpus, args.vocab_size)
    sampler = train_sampler(corpus, data_cfg, 1, seed)
    step = 0
    while True:
        yield sampler.microbatch(step, 0)
        step += 1


def _microbatch(args: ModelArgs, seq_len: int, batch: int, seed: int, data: str) -> tuple[torch.Tensor, ...]:
    return next(_batches(args, seq_len, batch, seed, data))


def _saved_bytes(
    model: Transformer, eb: EfficientBackward, efficient: bool, x: torch.Tensor, y: torch.Tensor
) -> tuple[int, int]:
    """Unique storage bytes autograd saves during one forward + loss: (total, inside the blocks)."""
    excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}
    in_blocks: set[int] = set()
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded:
            saved[ptr] = storage.nbytes()
            if inside[0]:
                in_blocks.add(ptr)
        return t

    def enter(*_: object) -> None:
        inside[0] = True

    def leave(*_: object) -> None:
        inside[0] = False

    hooks = [h for b in model.layers for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        with eb.enabled(efficient), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    finally:
        for h in hooks:
            h.remove()
    del loss
    return sum(saved.values()), sum(saved[p] for p in in_blocks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m unbroken.lab.bench_mecefo", description=__doc__.split("\n")[0])
    parser.add_argument("--flavour", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--data", default="shakespeare", choices=("shakespeare", "random"))
    parser.add_argument("--device", default="cpu", help="the microbatch benchmark's device (cpu, cuda)")
    parser.add_argument("--autocast", action="store_true", help="microbatch forwards under bfloat16 autocast")
    parser.add_argument("--ranks", default="", help="also run gradient_errors for these ranks, e.g. 8,16,32,full")
    parser.add_argument("--train-steps", type=int, default=300, help="exact steps before measuring gradient errors")
    parser.add_argument("--bases", action="store_true", help="run basis_errors instead (randomized vs full SVD)")
    parser.add_argument(
        "--refresh",
        default="",
        help="run bench_refresh instead for these OUTxIN shapes, e.g. 4096x11008,11008x4096 (with --device)",
    )
    parser.add_argument("--method", default="randomized", choices=("randomized", "svd"), help="for --refresh")
    parser.add_argument("--oversample", type=int, default=DEFAULT_OVERSAMPLE, help="for --refresh")
    parser.add_argument("--power-iters", type=int, default=DEFAULT_POWER_ITERS, help="for --refresh")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the arguments, say in one line what would run, and stop"
    )
    a = parser.parse_args(argv)
    shapes = _shapes(parser, a.refresh) if a.refresh else []
    if a.flavour not in FLAVOURS:
        parser.error(f"--flavour {a.flavour!r} is unknown; allowed: {', '.join(FLAVOURS)}")
    if a.dry_run:
        print(f"dry run: would {_what(a, shapes)} on {a.device}; nothing started or written")
        return
    common = {"flavour": a.flavour, "seq_len": a.seq_len, "batch": a.batch, "data": a.data}
    if a.refresh:
        _print_refresh(a, shapes)
        return
    if a.bases:
        _print_bases(basis_errors(train_steps=a.train_steps, **common), a.json)
        return
    result = bench_microbatch(rank=a.rank, repeats=a.repeats, device=a.device, autocast=a.autocast, **common)
    rows: list[dict[str, float | int]] = []
    if a.ranks:
        ranks = tuple(FULL_RANK if r.strip() == "full" else int(r) for r in a.ranks.split(","))
        rows = gradient_errors(ranks=ranks, train_steps=a.train_steps, **common)
        for row in rows:
            timed = bench_microbatch(rank=int(row["rank"]), repeats=a.repeats, **common)
            row.update(efficient_ms=timed["efficient_ms"], exact_ms=timed["exact_ms"], time_ratio=timed["time_ratio"])
    if a.json:
        print(json.dumps({"microbatch": result, "ranks": rows}, indent=2))
        return
    print(f"{a.flavour}, seq_len {a.seq_len}, batch {a.batch}, rank {a.rank}, {a.data} tokens", end="")
    print(f", {result['device']}, autocast {result['autocast']}, {result['threads']} threads")
    for name in ("exact", "efficient"):
        peak = f", peak {result[f'{name}_peak_bytes'] / 2**20:8.2f} MiB" if f"{name}_peak_bytes" in result else ""
        print(
            f"  {name:9s} {result[f'{name}_ms']:8.1f} ms (min {result[f'{name}_ms_min']:.1f}, "
            f"max {result[f'{name}_ms_max']:.1f})   saved {result[f'{name}_saved_bytes'] / 2**20:7.2f} MiB, "
            f"in blocks {result[f'{name}_block_saved_bytes'] / 2**20:7.2f} MiB{peak}"
        )
    print(
        f"  time ratio {result['time_ratio']:.3f} (expected from FLOPs {result['expected_flops_ratio']:.3f}); "
        f"memory ratio {result['memory_ratio']:.3f} (expected {result['expected_memory_ratio']:.3f}), "
        f"in blocks {result['block_memory_ratio']:.4f} (expected {result['expected_block_memory_ratio']:.4f})"
    )
    if rows:
        print(f"gradient errors after {a.train_steps} exact steps (relative, mean of 4 microbatches):")
        print("  rank   ffn_projection   ffn     model   model+attn   efficient ms   time ratio")
        for row in rows:
            r = "full" if row["rank"] == FULL_RANK else str(row["rank"])
            print(
                f"  {r:>5s}  {row['ffn_projection']:10.3f}  {row['ffn']:8.3f}  {row['model']:7.3f}  "
                f"{row['model_with_attention']:9.3f}  {row['efficient_ms']:11.1f}  {row['time_ratio']:10.3f}"
            )


def _shapes(parser: argparse.ArgumentParser, refresh: str) -> list[tuple[int, int]]:
    """``--refresh``'s OUTxIN shapes; the parser's one-line error (exit status 2) for a malformed one."""
    shapes = []
    for shape in refresh.split(","):
        sizes = shape.lower().split("x")
        if len(sizes) != 2 or not all(s.isdigit() and int(s) > 0 for s in sizes):
            parser.error(f"--refresh {shape!r}: expected OUTxIN, e.g. 4096x11008")
        shapes.append((int(sizes[0]), int(sizes[1])))
    return shapes


def _what(a: argparse.Namespace, shapes: list[tuple[int, int]]) -> str:
    """What ``main`` would run, in words (``--dry-run``)."""
    if shapes:
        how = (
            "a float64 full SVD" if a.method == "svd" else f"a randomized SVD (p = {a.oversample}, q = {a.power_iters})"
        )
        sizes = ", ".join(f"{o} x {i}" for o, i in shapes)
        return f"time {a.repeats} basis refresh{'es' * (a.repeats != 1)} by {how} of rank {a.rank} for {sizes}"
    if a.bases:
        return (
            f"train {a.flavour} {a.train_steps} exact steps on {a.data} tokens, then compare randomized bases with SVD"
        )
    ranks = f", then gradient errors at ranks {a.ranks}" if a.ranks else ""
    return f"time {a.repeats} efficient and exact microbatches of {a.flavour} (rank {a.rank}){ranks}"


def _print_refresh(a: argparse.Namespace, shapes: list[tuple[int, int]]) -> None:
    for out_features, in_features in shapes:
        r = bench_refresh(
            out_features,
            in_features,
            a.rank,
            a.oversample,
            a.power_iters,
            method=a.method,
            device=a.device,
            repeats=a.repeats,
        )
        if a.json:
            print(json.dumps(r))
            continue
        how = "float64 full SVD" if a.method == "svd" else f"randomized p={a.oversample} q={a.power_iters}"
        print(
            f"refresh {r['shape']} rank {a.rank}, {how}, {r['device']}, {r['threads']} threads: median "
            f"{r['median_s']:.3f} s [min {r['min_s']:.3f}, max {r['max_s']:.3f}] of {r['repeats']}"
        )


def _print_bases(rows: list[dict[str, float | int]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print("FFN weight-gradient projection error, randomized bases vs full SVD (mean of 4 microbatches):")
    print("  rank  p   q    svd    randomized   excess   sin_max")
    for row in rows:
        print(
            f"  {row['rank']:4d} {row['oversample']:3d} {row['power_iters']:2d}  {row['svd']:.4f}   "
            f"{row['randomized']:.4f}   {row['excess']:+.4f}   {row['sin_max']:.3f}"
        )


if __name__ == "__main__":
    main()
