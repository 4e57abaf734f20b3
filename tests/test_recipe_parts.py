"""Fast unit tests for the recipe building blocks (synthetic data, tokenizer, GPT)."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from recipes.common.data import (
    CharTokenizer,
    TextDataset,
    build_dataset,
    generate_corpus,
)
from recipes.common.model import GPT, GPTConfig

# sha256 of generate_corpus()[:10_000] (default num_chars and seed). If this changes,
# every recorded run/checkpoint built on the corpus is invalidated, so only update it
# deliberately.
PINNED_PREFIX_SHA256 = "a02961284b119d0f88dec290cae15fbdb1b95f8d4b0ff581a4854da8e696ea2a"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_corpus_is_deterministic() -> None:
    a = generate_corpus()
    b = generate_corpus()
    assert len(a) == 300_000
    assert _sha256(a) == _sha256(b)
    assert _sha256(a[:10_000]) == PINNED_PREFIX_SHA256


def test_corpus_prefix_stable_and_seed_sensitive() -> None:
    # Shorter corpora are prefixes of longer ones, so num_chars only truncates.
    assert generate_corpus(10_000) == generate_corpus()[:10_000]
    assert generate_corpus(10_000, seed=1) != generate_corpus(10_000, seed=2)


def test_corpus_does_not_touch_global_rng() -> None:
    import random

    random.seed(42)
    expected = random.random()
    random.seed(42)
    generate_corpus(5_000)
    assert random.random() == expected


def test_corpus_looks_like_prose() -> None:
    text = generate_corpus(50_000)
    words = {w.strip('.,;:!?"-').lower() for w in text.split()}
    assert len(words) > 200
    assert "\n\n" in text
    for ch in '.,?!"':
        assert ch in text


def test_tokenizer_round_trip() -> None:
    tok = CharTokenizer()
    assert tok.vocab_size == 96
    text = generate_corpus(5_000) + "Hello, World! 0123456789 ~`{}|\\"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    # Fresh instances agree, so the vocabulary does not depend on state.
    assert CharTokenizer().encode(text) == ids


def test_tokenizer_rejects_unknown_chars() -> None:
    with pytest.raises(ValueError):
        CharTokenizer().encode("tab\there")


def test_dataset_shapes_and_shift() -> None:
    block = 16
    ds, tok = build_dataset(block_size=block, num_chars=10_000)
    assert len(ds) == (10_000 - 1) // block
    for i in (0, 1, len(ds) - 1):
        idx, x, y = ds[i]
        assert idx == i
        assert x.shape == (block,) and y.shape == (block,)
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
        # y's last token is the first token of the next window (or the tail token).
        assert y[-1].item() == ds.data[(i + 1) * block].item()
    # Non-overlapping windows tile the data.
    _, x0, _ = ds[0]
    _, x1, _ = ds[1]
    assert torch.equal(torch.cat([x0, x1]), ds.data[: 2 * block])
    assert tok.decode(x0.tolist()) == generate_corpus(10_000)[:block]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_len_edge_cases() -> None:
    assert len(TextDataset(torch.arange(9), 4)) == 2
    assert len(TextDataset(torch.arange(8), 4)) == 1
    assert len(TextDataset(torch.arange(1), 4)) == 0


def test_default_config_matches_tokenizer() -> None:
    assert GPTConfig().vocab_size == CharTokenizer().vocab_size


def test_gpt_state_dict_has_no_buffers_or_aliases() -> None:
    model = GPT(GPTConfig())
    assert len(list(model.buffers())) == 0
    sd = model.state_dict()
    assert set(sd) == {name for name, _ in model.named_parameters()}
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == GPTConfig().n_layer


def test_gpt_initial_loss_near_uniform() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).eval()
    ds, _ = build_dataset(block_size=cfg.block_size, num_chars=20_000)
    x = torch.stack([ds[i][1] for i in range(4)])
    y = torch.stack([ds[i][2] for i in range(4)])
    logits, loss = model(x, y)
    assert logits.shape == (4, cfg.block_size, cfg.vocab_size)
    assert loss is not None and torch.isfinite(loss)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3
    _, no_loss = model(x)
    assert no_loss is None


def test_gpt_loss_decreases_on_one_batch() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    ds, _ = build_dataset(block_size=cfg.block_size, num_chars=20_000)
    x = torch.stack([ds[i][1] for i in range(4)])
    y = torch.stack([ds[i][2] for i in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0


def test_gpt_rejects_too_long_sequence() -> None:
    cfg = GPTConfig(block_size=8, n_layer=1, n_embd=32, n_head=2)
    with pytest.raises(ValueError):
        GPT(cfg)(torch.zeros(1, 9, dtype=torch.long))
