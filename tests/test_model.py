"""Tests for unbroken.train.model: shapes, causality, reference names, GQA, parameter counts, init, validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from unbroken.core import config
from unbroken.train.model import (
    FLAVOURS,
    ModelArgs,
    Transformer,
    apply_rotary_emb,
    flops_per_token,
    model_args,
    num_params,
    precompute_freqs_cis,
)

pytestmark = pytest.mark.timeout(60)

# Exact counts (untied tok_embeddings and output), checked against the meta-device modules below.
EXPECTED_PARAMS = {
    "tiny": 2_466_432,
    "small": 7_407_872,  # 5.3M without tok_embeddings
    "60m": 58_073_600,
    "130m": 134_105_856,
    "350m": 367_969_280,
    "1b": 1_339_082_752,
    "7b": 6_738_415_616,  # the published LLaMA-7B count
}
NOMINAL = {"60m": 60e6, "130m": 130e6, "350m": 350e6, "1b": 1e9, "7b": 7e9}


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(FLAVOURS["tiny"])


def random_tokens(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, FLAVOURS["tiny"].vocab_size, (batch, seq_len), generator=gen)


def test_flavour_names_match_config() -> None:
    assert tuple(FLAVOURS) == config.FLAVOURS


def test_forward_shape_and_dtype() -> None:
    model = tiny_model()
    logits = model(random_tokens(2, 16))
    assert logits.shape == (2, 16, FLAVOURS["tiny"].vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_full_length_forward() -> None:
    args = FLAVOURS["tiny"]
    logits = tiny_model()(random_tokens(1, args.max_seq_len))
    assert logits.shape == (1, args.max_seq_len, args.vocab_size)


def test_loss_decreases_when_overfitting_a_batch() -> None:
    model = tiny_model()
    tokens = random_tokens(2, 33)
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Init logits are near zero, so the first loss is close to log(vocab).
    assert losses[0] == pytest.approx(math.log(FLAVOURS["tiny"].vocab_size), rel=0.05)
    assert losses[-1] < 0.7 * losses[0]


def test_causality() -> None:
    model = tiny_model()
    tokens = random_tokens(2, 24)
    t = 10
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % FLAVOURS["tiny"].vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_state_dict_uses_reference_names_and_holds_no_buffers() -> None:
    model = tiny_model()
    keys = set(model.state_dict())
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(FLAVOURS["tiny"].n_layers):
        expected |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    assert keys == expected
    assert keys == {name for name, _ in model.named_parameters()}
    assert "freqs_cis" in dict(model.named_buffers())


def test_output_is_not_tied_to_embedding() -> None:
    model = tiny_model()
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    assert not torch.equal(model.output.weight, model.tok_embeddings.weight)


def test_grouped_query_attention_shapes() -> None:
    args = FLAVOURS["tiny"]
    assert args.n_kv_heads == 2 < args.n_heads
    attention = tiny_model().layers[0].attention
    kv_shape = (args.n_kv_heads * args.head_dim, args.dim)
    assert attention.wk.weight.shape == kv_shape
    assert attention.wv.weight.shape == kv_shape
    assert attention.wq.weight.shape == (args.dim, args.dim)
    assert attention.wo.weight.shape == (args.dim, args.dim)


def test_rotary_matches_complex_reference() -> None:
    B, T, n_heads, n_kv_heads, head_dim = 2, 7, 4, 2, 32
    xq = torch.randn(B, T, n_heads, head_dim)
    xk = torch.randn(B, T, n_kv_heads, head_dim)
    rq, rk = apply_rotary_emb(xq, xk, precompute_freqs_cis(head_dim, 16)[:T])

    # meta-llama/llama's complex formulation.
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    cis = torch.polar(torch.ones(T, head_dim // 2), torch.outer(torch.arange(T).float(), freqs))

    def ref(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3)

    torch.testing.assert_close(rq, ref(xq))
    torch.testing.assert_close(rk, ref(xk))


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_param_counts(flavour: str) -> None:
    args = FLAVOURS[flavour]
    with torch.device("meta"):
        model = Transformer(args)
    assert model.num_params() == num_params(args) == EXPECTED_PARAMS[flavour]
    if flavour in NOMINAL:
        assert abs(num_params(args) / NOMINAL[flavour] - 1) < 0.4


def test_flops_per_token() -> None:
    args = FLAVOURS["60m"]
    non_embedding = EXPECTED_PARAMS["60m"] - 32000 * 512  # the count above minus the embedding table
    expected = 6 * non_embedding + 12 * 8 * 512 * 256
    assert flops_per_token(args, 256) == expected
    assert flops_per_token(args, 512) > flops_per_token(args, 256)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(args, 0)


def test_same_seed_same_init_different_seed_different_init() -> None:
    a, b, c = (
        tiny_model(seed=1).state_dict(),
        tiny_model(seed=1).state_dict(),
        tiny_model(seed=2).state_dict(),
    )
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_init_distribution() -> None:
    args = FLAVOURS["tiny"]
    model = tiny_model()
    depth_std = 0.02 / math.sqrt(2 * args.n_layers)
    block = model.layers[0]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.output.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(depth_std, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(depth_std, rel=0.05)
    for norm in (block.attention_norm, block.ffn_norm, model.norm):
        assert torch.equal(norm.weight, torch.ones(args.dim))


def test_meta_build_then_materialise() -> None:
    with torch.device("meta"):
        model = Transformer(FLAVOURS["tiny"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = precompute_freqs_cis(FLAVOURS["tiny"].head_dim, FLAVOURS["tiny"].max_seq_len)
    torch.testing.assert_close(model.freqs_cis, reference)
    assert torch.isfinite(model(random_tokens(1, 8))).all()


def test_model_args_overrides() -> None:
    args = model_args("tiny", vocab_size=300, n_kv_heads=4, max_seq_len=64)
    assert (args.vocab_size, args.n_kv_heads, args.max_seq_len) == (300, 4, 64)
    assert args.dim == FLAVOURS["tiny"].dim
    assert model_args("60m") == FLAVOURS["60m"]


def test_unknown_flavour_raises() -> None:
    with pytest.raises(ValueError, match="allowed: tiny, small, 60m"):
        model_args("huge")


def test_sequence_longer_than_max_seq_len_raises() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(random_tokens(1, FLAVOURS["tiny"].max_seq_len + 1))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dim": 130}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "divisible by n_kv_heads"),
        ({"n_layers": 0}, "n_layers = 0"),
        ({"vocab_size": -1}, "vocab_size = -1"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, "even"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_invalid_args_raise(overrides: dict[str, float], match: str) -> None:
    base = {
        "dim": 128,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 256,
        "ffn_hidden": 352,
        "max_seq_len": 32,
    }
    with pytest.raises(ValueError, match=match):
        ModelArgs(**(base | overrides))


def test_model_args_override_is_validated() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        model_args("tiny", n_kv_heads=3)
