"""Tests for unbroken.ft.mecefo: MeCeFO's efficient mode on our model and on a Hugging Face LlamaForCausalLM."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unbroken.ft.mecefo import EfficientBackward, EfficientConfig, apply_efficient_backward, basis_seed
from unbroken.train.model import FLAVOURS, Transformer

pytestmark = pytest.mark.timeout(60)

FULL = 10**6  # a rank above every width: exact weight gradients


@dataclass
class Kind:
    """How to build, run and take apart one model family."""

    build: Callable[[int], nn.Module]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    vocab: int
    blocks: Callable[[nn.Module], list[nn.Module]]
    ffn: Callable[[nn.Module], tuple[nn.Module, nn.Module, tuple[nn.Linear, nn.Linear, nn.Linear]]]
    attention_names: tuple[str, ...]  # parameter-name fragments of the attention sub-block


def _ours(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Transformer(FLAVOURS["tiny"])


def _hf(seed: int, mlp_bias: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        mlp_bias=mlp_bias,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


OURS = Kind(
    build=_ours,
    logits=lambda m, x: m(x),
    vocab=FLAVOURS["tiny"].vocab_size,
    blocks=lambda m: list(m.layers),
    ffn=lambda b: (b.ffn_norm, b.feed_forward, (b.feed_forward.w1, b.feed_forward.w3, b.feed_forward.w2)),
    attention_names=(".attention.", ".attention_norm."),
)
HF = Kind(
    build=_hf,
    logits=lambda m, x: m(input_ids=x, use_cache=False).logits,
    vocab=256,
    blocks=lambda m: list(m.model.layers),
    ffn=lambda b: (b.post_attention_layernorm, b.mlp, (b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj)),
    attention_names=(".self_attn.", ".input_layernorm."),
)


@pytest.fixture(params=[OURS, HF], ids=["ours", "hf"])
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param


def tokens(kind: Kind, batch: int = 2, seq_len: int = 17, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, kind.vocab, (batch, seq_len), generator=gen)


def loss_and_grads(kind: Kind, model: nn.Module, toks: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = kind.logits(model, toks[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def transformed(kind: Kind, rank: int = 8, seed: int = 0) -> tuple[nn.Module, EfficientBackward]:
    model = kind.build(seed)
    return model, apply_efficient_backward(model, EfficientConfig(rank=rank))


def test_exact_mode_is_bit_identical_to_the_untransformed_model(kind: Kind) -> None:
    reference = kind.build(0)
    model, eb = transformed(kind)
    toks = tokens(kind)
    want_logits, want = loss_and_grads(kind, reference, toks)
    got_logits, got = loss_and_grads(kind, model, toks)
    with eb.enabled():  # an efficient microbatch in between changes nothing for the next exact one
        loss_and_grads(kind, model, toks)
    with eb.enabled(False):
        again_logits, again = loss_and_grads(kind, model, toks)
    for logits, grads in ((got_logits, got), (again_logits, again)):
        assert torch.equal(logits, want_logits)
        assert grads.keys() == want.keys()
        assert all(torch.equal(grads[n], want[n]) for n in want)


def test_efficient_forward_values_are_exact(kind: Kind) -> None:
    model, eb = transformed(kind)
    toks = tokens(kind)
    exact = kind.logits(model, toks)
    with eb.enabled():
        efficient = kind.logits(model, toks)
    assert torch.equal(efficient, exact)


def test_attention_gets_no_gradient_and_everything_else_does(kind: Kind) -> None:
    model, eb = transformed(kind)
    with eb.enabled():
        _, grads = loss_and_grads(kind, model, tokens(kind))
    attention = {id(p) for p in eb.attention_parameters()}
    for name, p in model.named_parameters():
        is_attention = any(fragment in f".{name}" for fragment in kind.attention_names)
        assert (id(p) in attention) == is_attention, name
        if is_attention:
            assert p.grad is None, name
        else:
            assert name in grads and grads[name].abs().sum() > 0, name


def test_backward_after_leaving_the_context(kind: Kind) -> None:
    model, eb = transformed(kind)
    toks = tokens(kind)
    with eb.enabled():
        _, inside = loss_and_grads(kind, model, toks)
    model.zero_grad(set_to_none=True)
    with eb.enabled():
        logits = kind.logits(model, toks[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten()).backward()
    outside = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert outside.keys() == inside.keys()
    assert all(torch.equal(outside[n], inside[n]) for n in inside)


def ffn_grads(
    kind: Kind, block: nn.Module, h: torch.Tensor, g: torch.Tensor, autocast: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of <g, mlp(ffn_norm(h))> w.r.t. h, the norm weight and the gate, up, down weights; with
    ``autocast``, the forward runs under ``torch.autocast("cpu", autocast)`` and the backward after it."""
    norm, mlp, linears = kind.ffn(block)
    block.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = mlp(norm(h))
    out.backward(g.to(out.dtype))
    return h.grad, norm.weight.grad, [linear.weight.grad for linear in linears]


@pytest.mark.parametrize("rank", [8, FULL])
def test_ffn_input_gradient_is_exact_and_weight_gradient_is_projected(kind: Kind, rank: int) -> None:
    model, eb = transformed(kind, rank=rank)
    block = kind.blocks(model)[0]
    _, _, linears = kind.ffn(block)
    dim = linears[0].in_features
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 9, dim, generator=gen)
    g = torch.randn(2, 9, dim, generator=gen)
    want_h, want_norm, want_w = ffn_grads(kind, block, h, g)
    with eb.enabled():
        got_h, got_norm, got_w = ffn_grads(kind, block, h, g)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_norm, want_norm, rtol=1e-5, atol=1e-5)
    bases = eb.named_bases()
    names = {id(p): n for n, p in model.named_parameters()}
    for linear, got, want in zip(linears, got_w, want_w, strict=True):
        v = bases.get(names[id(linear.weight)])
        if rank == FULL:
            assert v is None
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert v.shape == (linear.in_features, rank)
            torch.testing.assert_close(v.T @ v, torch.eye(rank), rtol=0, atol=1e-5)
            torch.testing.assert_close(got, want @ v @ v.T, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(got, want, rtol=1e-3, atol=1e-6)


def test_ffn_biases_get_exact_gradients() -> None:
    model = _hf(0, mlp_bias=True)
    eb = apply_efficient_backward(model, EfficientConfig(rank=8))
    block = model.model.layers[1]
    linears = (block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj)
    gen = torch.Generator().manual_seed(2)
    h, g = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)
    want_h, _, _ = ffn_grads(HF, block, h, g)
    want_b = [linear.bias.grad for linear in linears]
    with eb.enabled():
        got_h, _, _ = ffn_grads(HF, block, h, g)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-6)
    for linear, want in zip(linears, want_b, strict=True):
        torch.testing.assert_close(linear.bias.grad, want, rtol=1e-5, atol=1e-6)


BF16_UNIT_ROUNDOFF = 2.0**-8
NUM_BF16_ROUNDINGS = 15  # on the longest path of the FFN's efficient backward; see the test below


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def test_efficient_backward_under_bf16_autocast_is_float32_up_to_bf16_rounding(kind: Kind) -> None:
    """An efficient microbatch's FFN gradients under ``torch.autocast("cpu", bfloat16)``, with the backward
    run after leaving the context, against the float32 efficient ones (same bases).

    The backward recomputes the FFN under the forward's autocast state, so every matmul rounds its inputs
    and its output to bfloat16 (unit roundoff u = 2^-8) and accumulates in float32 (the products of bf16
    numbers are exact there and the float32 sums add ~2^-24 per term: negligible); the norm stays float32.
    Roundings on the path to each gradient (x the norm output, W1 gate, W3 up, W2 down):
    a = x W1^T: x, W1, a (3); u = x W3^T: W3, u (2); s = silu(a) (1); g_y, the output gradient (1);
    g_p = g_y W2: W2, g_p (2); g_p * u (1); silu's backward, g_a (1); g_u = g_p * s (1); so g_a carries 11
    and g_u 8 (12 distinct together). g_x = g_a W1 + g_u W3: two products and a sum (3), hence h's and the
    norm weight's gradient: 15. Weight gradients G^T (x V) V^T: V, x V, G^T (.), (.) V^T (4): gate 11 + 4,
    up 8 + 4, down (g_y and s * u: 1 + 7) + 4. Each rounding moves its operand by at most u relative; it
    reaches the result through products with factors it is independent of (random data and weights), so
    not amplified to first order: the normwise relative error is at most 15 u = 15/256 for every gradient.
    """
    model, eb = transformed(kind)
    eb.refresh(0)
    block = kind.blocks(model)[0]
    dim = kind.ffn(block)[2][0].in_features
    gen = torch.Generator().manual_seed(3)
    h, g = torch.randn(2, 9, dim, generator=gen), torch.randn(2, 9, dim, generator=gen)
    with eb.enabled():
        want_h, want_norm, want_w = ffn_grads(kind, block, h, g)
        got_h, got_norm, got_w = ffn_grads(kind, block, h, g, autocast=torch.bfloat16)
    pairs = zip([got_h, got_norm, *got_w], [want_h, want_norm, *want_w], strict=True)
    errors = [relative_error(got, want) for got, want in pairs]
    assert all(e <= NUM_BF16_ROUNDINGS * BF16_UNIT_ROUNDOFF for e in errors), errors
    assert all(e > 0 for e in errors), errors  # bfloat16 was used
    assert all(t.dtype == torch.float32 for t in (got_h, got_norm, *got_w))
    with eb.enabled():  # a float32 forward is recomputed in float32 even if its backward runs under autocast
        model.zero_grad(set_to_none=True)
        h32 = h.clone().requires_grad_()
        out = kind.ffn(block)[1](kind.ffn(block)[0](h32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.backward(g)
    assert torch.equal(h32.grad, want_h)
    model.zero_grad(set_to_none=True)
    with eb.enabled(), torch.autocast("cpu", dtype=torch.bfloat16):  # and the whole model runs
        logits = kind.logits(model, tokens(kind))
    logits.float().square().mean().backward()
    attention = {id(p) for p in eb.attention_parameters()}
    for p in model.parameters():
        assert (p.grad is None) == (id(p) in attention)
        assert p.grad is None or (p.grad.dtype == p.dtype and bool(torch.isfinite(p.grad).all()))


def test_block_input_gradient_goes_through_the_residual_only(kind: Kind) -> None:
    model, eb = transformed(kind, rank=FULL)
    block = kind.blocks(model)[0]
    norm, mlp, _ = kind.ffn(block)
    attention_norm = next(m for m in block.children() if m is not norm and isinstance(m, type(norm)))
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, t: torch.Tensor) -> None:
        t.retain_grad()
        seen[name] = t

    hooks = [
        attention_norm.register_forward_pre_hook(lambda _, args: keep("x", args[0])),  # the block input
        norm.register_forward_pre_hook(lambda _, args: keep("h", args[0])),  # the stream after attention
        mlp.register_forward_hook(lambda _, args, out: keep("ffn_out", out)),  # its grad is the block output's
    ]
    with eb.enabled():
        kind.logits(model, tokens(kind, batch=1, seq_len=8)).square().mean().backward()
    for hook in hooks:
        hook.remove()
    assert torch.equal(seen["x"].grad, seen["h"].grad)
    exact_h = seen["h"].detach().requires_grad_()
    (exact_h + mlp(norm(exact_h))).backward(seen["ffn_out"].grad)
    torch.testing.assert_close(seen["h"].grad, exact_h.grad, rtol=1e-5, atol=1e-7)


def scale_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)


def test_bases_refresh_once_per_window_when_needed_and_match_across_copies(kind: Kind) -> None:
    models = [kind.build(0), kind.build(0)]
    handles = [apply_efficient_backward(m, EfficientConfig(rank=4, refresh_every=10)) for m in models]
    assert handles[0].bases() == [] and handles[0].bases_step is None  # nothing computed at apply time
    assert not handles[0].refresh(0, needed=False) and handles[0].bases() == []
    assert [eb.refresh(0) for eb in handles] == [True, True]
    assert not handles[0].refresh(0)  # in flight or held: a repeated call is free
    first = handles[0].named_bases()
    assert handles[0].bases_step == 0 and len(first) == 3 * len(kind.blocks(models[0]))
    assert all(torch.equal(first[n], handles[1].named_bases()[n]) for n in first)  # bit-identical
    for m in models:
        scale_weights(m)
    before = handles[0].bases()
    assert not any(eb.refresh(s) for eb in handles for s in (4, 9))  # the same window
    assert not any(eb.refresh(s, needed=False) for eb in handles for s in (10, 11, 15))  # no failure yet
    assert all(a is b for a, b in zip(handles[0].bases(), before, strict=True))
    assert [eb.refresh(17, needed=True) for eb in handles] == [True, True]  # window 1's first needed step
    second = [eb.named_bases() for eb in handles]
    assert [eb.bases_step for eb in handles] == [17, 17]
    assert all(torch.equal(second[0][n], second[1][n]) for n in first)
    assert any(not torch.equal(second[0][n], first[n]) for n in first)
    assert not handles[0].refresh(19) and not handles[0].refresh(25, needed=False)
    assert handles[0].refresh(5)  # a step before bases_step (a run resumed from earlier): recomputed
    handles[0].wait()
    assert handles[0].bases_step == 5


def test_a_late_or_lazy_handle_computes_the_same_bases(kind: Kind) -> None:
    """The bases of a refresh step are a function of the weights and that step only: a handle built later
    on the same weights, or one that computes them on first use in an efficient forward, gets the same."""
    model = kind.build(0)
    eb = apply_efficient_backward(model, EfficientConfig(rank=4, refresh_every=10))
    eb.refresh(0)
    eb.wait()  # before writing the weights (an optimizer step would join it itself)
    scale_weights(model)
    eb.refresh(20)
    want = eb.bases()
    late_model = kind.build(1)
    late_model.load_state_dict(model.state_dict())
    late = apply_efficient_backward(late_model, EfficientConfig(rank=4, refresh_every=10))
    assert late.refresh(20)
    assert all(torch.equal(a, b) for a, b in zip(late.bases(), want, strict=True))
    lazy_model = kind.build(2)
    lazy_model.load_state_dict(model.state_dict())
    lazy = apply_efficient_backward(lazy_model, EfficientConfig(rank=4, refresh_every=10))
    lazy.refresh(20, needed=False)  # this worker adopts nothing yet
    assert lazy.bases() == []
    with lazy.enabled():
        kind.logits(lazy_model, tokens(kind)).sum().backward()  # computes them, keyed to step 20
    assert lazy.bases_step == 20
    assert all(torch.equal(a, b) for a, b in zip(lazy.bases(), want, strict=True))
    rejoined = apply_efficient_backward(kind.build(3), EfficientConfig(rank=4, refresh_every=10))
    rejoined.load_bases(want, step=20)
    assert not rejoined.refresh(27)  # the window's bases arrived with the state: not recomputed
    assert all(torch.equal(a, b) for a, b in zip(rejoined.bases(), want, strict=True))


@pytest.mark.parametrize("threads", [1, 2])
def test_bases_computed_in_the_background_are_those_of_the_calling_thread(threads: int) -> None:
    """The refresh thread computes every block's bases with the process's intra-op threads: each basis is
    bitwise ``randomized_basis`` of its weight called on the training thread, whatever the block's place in
    the model (a pipeline stage holds other blocks first) and whatever the host's core count. On a new thread
    the first LAPACK calls otherwise run with OpenMP's default thread count (this machine's 2 cores)."""
    from unbroken.ft.mecefo import randomized_basis

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = OURS.build(0)
        config = EfficientConfig(rank=8)
        eb = apply_efficient_backward(model, config)
        eb.refresh(5)
        got = eb.named_bases()
        eb.remove()
        names = {id(p): n for n, p in model.named_parameters()}
        for i, block in enumerate(model.layers):
            for k, linear in enumerate(OURS.ffn(block)[2]):
                want = randomized_basis(
                    linear.weight, config.rank, config.oversample, config.power_iters, basis_seed(5, f"layers.{i}", k)
                )
                assert want is not None and torch.equal(got[names[id(linear.weight)]], want), (i, k)
    finally:
        torch.set_num_threads(previous)


def test_the_computation_is_joined_before_the_weights_change() -> None:
    model = OURS.build(0)
    eb = apply_efficient_backward(model, EfficientConfig(rank=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert eb.refresh(0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # the global step pre-hook joins it before the weights move
    assert eb.bases_step == 0
    assert eb.refresh(100)
    with torch.no_grad():
        model.layers[0].feed_forward.w1.weight.add_(1.0)  # written behind the handle's back
    with pytest.raises(RuntimeError, match="call EfficientBackward.wait"):
        eb.wait()
    assert eb.refresh(200)
    with torch.no_grad():
        model.layers[0].feed_forward.w1.weight.add_(1.0)
    eb.load_bases([])  # a state received from a peer supersedes the computation in flight
    assert eb.bases() == [] and eb.bases_step is None


def test_the_forward_does_not_wait_for_the_bases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bases are used in the backward only: an efficient forward runs while they are still computed."""
    from unbroken.ft.mecefo import bases as computed  # where the bases' thread looks randomized_basis up

    release, computing = threading.Event(), threading.Event()
    compute = computed.randomized_basis

    def held_back(*args: object) -> torch.Tensor | None:
        computing.set()
        assert release.wait(30)
        return compute(*args)

    monkeypatch.setattr(computed, "randomized_basis", held_back)
    model, eb = transformed(OURS)
    toks = tokens(OURS)
    with eb.enabled():
        logits = OURS.logits(model, toks[:, :-1])  # starts the computation (no refresh said "needed")
    assert computing.wait(30) and not release.is_set()
    release.set()
    F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten()).backward()
    assert eb.bases_step == 0 and len(eb.bases()) == 3 * len(model.layers)


def test_load_bases_round_trip(kind: Kind) -> None:
    source, target = (apply_efficient_backward(kind.build(seed), EfficientConfig(rank=4)) for seed in (0, 1))
    for eb in (source, target):
        eb.refresh(0)
    assert any(not torch.equal(a, b) for a, b in zip(source.bases(), target.bases(), strict=True))
    target.load_bases(source.bases(), step=source.bases_step)
    assert target.bases_step == 0
    assert all(torch.equal(a, b) for a, b in zip(source.bases(), target.bases(), strict=True))
    other = apply_efficient_backward(kind.build(0), EfficientConfig(rank=5))
    other.refresh(0)
    with pytest.raises(ValueError, match="bases do not match"):
        target.load_bases(other.bases(), step=0)
    target.load_bases(source.bases())  # no step (a state saved before bases had one): dropped
    assert target.bases() == [] and target.bases_step is None


def planted(out_features: int, in_features: int, k: int, gap: float, seed: int) -> tuple[torch.Tensor, ...]:
    """W = U diag(s) V^T with s = 1 (k times), then ``gap``: returns (W, U, V) in float64."""
    gen = torch.Generator().manual_seed(seed)
    n = min(out_features, in_features)
    u = torch.linalg.qr(torch.randn(out_features, out_features, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(in_features, in_features, generator=gen, dtype=torch.float64)).Q
    s = torch.tensor([1.0] * k + [gap] * (n - k), dtype=torch.float64)
    return u[:, :n] @ torch.diag(s) @ v[:, :n].T, u, v


def sin_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """The sine of the largest principal angle between the column spans of orthonormal a and b (same width)."""
    return float(torch.linalg.matrix_norm(a - b @ (b.T @ a), ord=2))


def test_randomized_bases_are_within_the_gap_bound_of_the_svd() -> None:
    """The handle's bases against the exact top-r right singular vectors, on FFN weights with a planted gap.

    Each FFN weight is set to W = U diag(s) V^T with s = 1 for the top r and gamma = 0.1 below: sigma_{r+1} /
    sigma_r = gamma. The handle computes Q = orth((W^T W)^q W^T Omega) and the top-r Ritz vectors V~ of W on
    span(Q). Bound, from first principles:

    1. Range finder (Halko, Martinsson, Tropp 2011, sec. 9): W^T = V S U^T, so with Omega_1 = U_r^T Omega
       and Omega_2 = U_mid^T Omega (U_mid: the left singular vectors of the gamma's), range(Q) contains the
       span of Y Omega_1^+ = V_r + gamma^(2q+1) V_mid Omega_2 Omega_1^+, whose largest angle to V_r has tangent
       t = gamma^(2q+1) ||Omega_2 Omega_1^+||; so sin theta_Q <= t / sqrt(1 + t^2). Omega is redrawn here from
       the handle's seed.
    2. Ritz step (Davis-Kahan sin-theta theorem): Q lies in W's row space, where M = W^T W = gamma^2 I +
       (1 - gamma^2) V_r V_r^T, so the residual (I - QQ^T) M Q Y has norm <= sin theta_Q, the r-th Ritz
       value is >= cos^2 theta_Q and the rest of M's spectrum is <= gamma^2:
       sin theta(V_r, V~) <= sin theta_Q / (cos^2 theta_Q - gamma^2).
    3. float32 rounding: at most u_32 n sigma_1 / sigma_n = 2^-24 * in_features / gamma, added.

    A gradient's projection error then moves by at most that angle: | ||G (I - V~V~^T)|| - ||G (I - V V^T)|| |
    <= ||G|| ||V~V~^T - V V^T||_2 = ||G|| sin theta_max, checked on an efficient microbatch's FFN gradients
    (with 2^-20 relative slack: V~ is orthonormal to float32 precision only).
    """
    rank, gamma = 8, 0.1
    config = EfficientConfig(rank=rank)
    model = OURS.build(0)
    exact: dict[str, torch.Tensor] = {}
    bounds: dict[str, float] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for i, block in enumerate(model.layers):
        for k, linear in enumerate(OURS.ffn(block)[2]):
            out_features, in_features = linear.weight.shape
            w, u, v = planted(out_features, in_features, rank, gamma, seed=10 * i + k)
            with torch.no_grad():
                linear.weight.copy_(w)
            width = min(rank + config.oversample, out_features, in_features)
            gen = torch.Generator().manual_seed(basis_seed(0, f"layers.{i}", k))
            omega = torch.randn(out_features, width, generator=gen).double()
            n = min(out_features, in_features)
            omega_2_omega_1_pinv = (u[:, rank:n].T @ omega) @ torch.linalg.pinv(u[:, :rank].T @ omega)
            t = gamma ** (2 * config.power_iters + 1) * float(torch.linalg.matrix_norm(omega_2_omega_1_pinv, 2))
            sin_q = t / (1 + t * t) ** 0.5
            bound = sin_q / (1 - sin_q**2 - gamma**2) + 2**-24 * in_features / gamma
            name = names[id(linear.weight)]
            exact[name], bounds[name] = v[:, :rank], bound
    eb = apply_efficient_backward(model, config)
    eb.refresh(0)
    got = {n: v.double() for n, v in eb.named_bases().items()}
    angles = {n: sin_max(exact[n], got[n]) for n in exact}
    assert all(angles[n] <= bounds[n] for n in exact), (angles, bounds)
    full_model = OURS.build(0)
    full_model.load_state_dict(model.state_dict())
    full = apply_efficient_backward(full_model, EfficientConfig(rank=FULL))
    with full.enabled():
        _, grads = loss_and_grads(OURS, full_model, tokens(OURS))
    for n in exact:
        g = grads[n].double()
        e_svd = torch.linalg.matrix_norm(g - g @ exact[n] @ exact[n].T)
        e_rand = torch.linalg.matrix_norm(g - g @ got[n] @ got[n].T)
        assert abs(float(e_rand - e_svd)) <= (angles[n] + 2**-20) * float(torch.linalg.matrix_norm(g)), n


def test_the_transform_adds_no_state(kind: Kind) -> None:
    model = kind.build(0)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    num_params = len(list(model.parameters()))
    eb = apply_efficient_backward(model)
    assert model.state_dict().keys() == before.keys()
    assert len(list(model.parameters())) == num_params
    eb.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_efficient_mode_keeps_one_tensor_per_block() -> None:
    model, eb = transformed(OURS)
    args = FLAVOURS["tiny"]
    toks = tokens(OURS, batch=2, seq_len=16)
    saved: dict[str, dict[int, int]] = {"exact": {}, "efficient": {}}
    where: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if where:
            storage = t.untyped_storage()
            saved[where[0]][storage.data_ptr()] = storage.nbytes()
        return t

    hooks = [b.register_forward_pre_hook(lambda *_: where.append(mode)) for b in model.layers]
    hooks += [b.register_forward_hook(lambda *_: where.clear()) for b in model.layers]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for mode in ("exact", "efficient"):
        with eb.enabled(mode == "efficient"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(toks)
    for mode in saved:
        for ptr in params | {model.freqs_cis.untyped_storage().data_ptr()}:
            saved[mode].pop(ptr, None)
    assert len(saved["efficient"]) == args.n_layers
    assert sum(saved["efficient"].values()) == args.n_layers * toks.numel() * args.dim * 4
    assert sum(saved["exact"].values()) > 10 * sum(saved["efficient"].values())


def test_errors() -> None:
    with pytest.raises(ValueError, match="rank"):
        EfficientConfig(rank=0)
    with pytest.raises(ValueError, match="refresh_every"):
        EfficientConfig(refresh_every=0)
    with pytest.raises(ValueError, match="no LLaMA-family block"):
        apply_efficient_backward(nn.Sequential(nn.Linear(4, 4)))
    model = OURS.build(0)
    apply_efficient_backward(model)
    with pytest.raises(ValueError, match="transformed twice"):
        apply_efficient_backward(model)


def test_refuses_checkpointed_hf_blocks() -> None:
    model = HF.build(0)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match="checkpointing"):
        apply_efficient_backward(model)


def test_rejects_a_block_whose_mlp_does_not_read_its_norm() -> None:
    model, eb = transformed(OURS)
    block = model.layers[0]
    block.forward = lambda x, freqs_cis: x + block.feed_forward(x)  # skips ffn_norm
    with eb.enabled(), pytest.raises(RuntimeError, match="not the output of its pre-FFN norm"):
        model(tokens(OURS))


def test_bench_microbatch_memory_matches_the_analytic_count() -> None:
    """The saved bytes, counted by the bench, are the analytic float32 count to the byte. The analytic ratios count
    the float activations only; autograd also keeps the microbatch's int64 tokens (the embedding's indices: the
    storage of the (batch, seq_len + 1) window the inputs are a view of), the int64 targets (cross_entropy's:
    flattened, a copy of their own) and the loss's float32 total weight (a scalar), the same in both modes."""
    from unbroken.lab.bench_mecefo import bench_microbatch, expected_ratios
    from unbroken.train.model import model_args

    seq_len, batch, rank = 16, 2, 8
    result = bench_microbatch(
        flavour="tiny", seq_len=seq_len, batch=batch, rank=rank, repeats=1, warmup=0, data="random"
    )
    args = model_args("tiny", max_seq_len=max(seq_len, model_args("tiny").max_seq_len))  # the bench's model
    expected = expected_ratios(args, seq_len, batch, rank)
    tokens, f32, i64 = seq_len * batch, 4, 8
    exact_block = int(expected["exact_block_floats_per_token"]) * tokens * f32
    efficient_block = args.dim * tokens * f32  # the FFN sub-block's input, per block
    beside = int(expected["head_floats_per_token"]) * tokens * f32 + (batch * (seq_len + 1) + tokens) * i64 + f32
    assert result["exact_block_saved_bytes"] == args.n_layers * exact_block
    assert result["efficient_block_saved_bytes"] == args.n_layers * efficient_block
    assert result["exact_saved_bytes"] == args.n_layers * exact_block + beside
    assert result["efficient_saved_bytes"] == args.n_layers * efficient_block + beside
    assert result["block_memory_ratio"] == result["expected_block_memory_ratio"] == efficient_block / exact_block
    assert 0 < result["expected_flops_ratio"] < 1 and result["efficient_ms"] > 0
