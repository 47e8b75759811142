"""Tests for unbroken.ft.efficient: MeCeFO's efficient mode on our model and on a Hugging Face LlamaForCausalLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unbroken.ft.efficient import EfficientBackward, EfficientConfig, apply_efficient_backward
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
    kind: Kind, block: nn.Module, h: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of <g, mlp(ffn_norm(h))> w.r.t. h, the norm weight and the gate, up, down weights."""
    norm, mlp, linears = kind.ffn(block)
    block.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    mlp(norm(h)).backward(g)
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


def test_bases_refresh_every_tau_steps_and_match_across_copies(kind: Kind) -> None:
    models = [kind.build(0), kind.build(0)]
    handles = [apply_efficient_backward(m, EfficientConfig(rank=4, refresh_every=10)) for m in models]
    first = handles[0].named_bases()
    assert len(first) == 3 * len(kind.blocks(models[0]))
    assert all(torch.equal(first[n], handles[1].named_bases()[n]) for n in first)
    assert handles[0].refresh(0) and all(torch.equal(handles[0].named_bases()[n], first[n]) for n in first)
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.mul_(1.5).add_(0.01)
    before = handles[0].bases()
    assert not any(eb.refresh(s) for eb in handles for s in (4, 9, 11, 19))
    assert all(a is b for a, b in zip(handles[0].bases(), before, strict=True))
    assert [eb.refresh(20) for eb in handles] == [True, True]
    assert handles[0].bases_step == 20
    second = [eb.named_bases() for eb in handles]
    assert all(torch.equal(second[0][n], second[1][n]) for n in first)
    assert any(not torch.equal(second[0][n], first[n]) for n in first)


def test_load_bases_round_trip(kind: Kind) -> None:
    source, target = (apply_efficient_backward(kind.build(seed), EfficientConfig(rank=4)) for seed in (0, 1))
    assert any(not torch.equal(a, b) for a, b in zip(source.bases(), target.bases(), strict=True))
    target.load_bases(source.bases())
    assert all(torch.equal(a, b) for a, b in zip(source.bases(), target.bases(), strict=True))
    with pytest.raises(ValueError, match="bases do not match"):
        target.load_bases(apply_efficient_backward(kind.build(0), EfficientConfig(rank=5)).bases())


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
    from unbroken.lab.bench_mecefo import bench_microbatch

    result = bench_microbatch(flavour="tiny", seq_len=16, batch=2, rank=8, repeats=1, warmup=0, data="random")
    assert result["block_memory_ratio"] == pytest.approx(result["expected_block_memory_ratio"], rel=1e-9)
    assert result["memory_ratio"] == pytest.approx(result["expected_memory_ratio"], rel=0.01)
    assert 0 < result["expected_flops_ratio"] < 1 and result["efficient_ms"] > 0
