"""The run's corpus from a ``[data]`` section, and its samplers: what a training loop calls.

Owns deciding what ``data.source`` holds (prepared data, read in place by ``reader``; or text, tokenized once
into the cache by ``textcache``), the checks every run makes of its corpus (a microbatch's worth of windows
in each split, a model vocabulary that covers every id, settings that do not apply), and which sampler reads
it: ``PreparedMicrobatchSampler`` in the Feistel order for prepared data and in the stored order for the text
cache (the order runs on text have always had: their losses stay what they were), ``EvalSampler`` for
validation. Both are pure functions of ``(seed, step, microbatch id)``, so any worker can compute any
microbatch::

    corpus = open_corpus(cfg.data)
    train = train_sampler(corpus, cfg.data, cfg.train.microbatches, cfg.train.seed)
    inputs, targets = train.microbatch(step, mb_id)
"""

from __future__ import annotations

import logging

from unbroken.core.config import DataConfig
from unbroken.data.reader import PreparedCorpus, detect_format, open_prepared
from unbroken.data.sampler import EvalSampler, PreparedMicrobatchSampler, WindowOrder, num_windows
from unbroken.data.textcache import SHAKESPEARE, prepare_text, user_tokenizer_file

logger = logging.getLogger(__name__)


def is_prepared(cfg: DataConfig) -> bool:
    """Whether ``cfg.source`` holds prepared data (read in place) rather than text (tokenized and cached)."""
    return cfg.source != SHAKESPEARE and detect_format(cfg.source) is not None


def open_corpus(cfg: DataConfig, verify: bool = False) -> PreparedCorpus:
    """The run's corpus: prepared data opened in place, or the text of ``textcache.prepare_text``.

    Nothing is loaded: the splits are ``TokenStream``s that read the windows asked for. Prepared data's
    vocabulary is the one its index (or stored tokenizer) gives; ``data.tokenizer``, when set, must be the
    tokenizer the data was made with; ``data.vocab_size`` and ``data.text_field`` do not apply to it (a warning
    says so when they are set).

    Args:
        cfg: the data section.
        verify: prepared data: also check every file's sha256 (one sequential read of the corpus: done once,
            before the workers start). Sizes are always checked.

    Raises:
        ValueError: one line: what ``prepare_text`` refuses; for prepared data, an unfinished or damaged
            preparation (size or checksum), a different tokenizer (both fingerprints named); for either, a
            split too small for one microbatch.
    """
    if not is_prepared(cfg):
        corpus = prepare_text(cfg)
        _check_windows(cfg, corpus)
        return corpus
    corpus = open_prepared(cfg.source, cfg.val_fraction, cfg.tokenizer, verify=verify)
    _check_windows(cfg, corpus)
    defaults = DataConfig()
    ignored = [
        f"data.{k}"
        for k in ("vocab_size", "text_field")
        if getattr(cfg, k) != getattr(defaults, k) and not (k == "vocab_size" and cfg.vocab_size == corpus.vocab_size)
    ]
    if ignored:
        logger.warning("%s: %s do not apply to prepared data (ignored)", corpus.description, ", ".join(ignored))
    return corpus


def train_sampler(corpus: PreparedCorpus, cfg: DataConfig, microbatches: int, seed: int) -> PreparedMicrobatchSampler:
    """The training sampler of ``corpus``: ``microbatch(step, mb_id)``, a pure function of ``seed``."""
    order = WindowOrder.STORED if corpus.format == "text" else WindowOrder.FEISTEL
    return PreparedMicrobatchSampler(corpus.train, cfg.seq_len, cfg.microbatch_size, microbatches, seed, order)


def eval_sampler(corpus: PreparedCorpus, cfg: DataConfig, count: int) -> EvalSampler:
    """The fixed validation microbatches of ``corpus`` (``count`` per evaluation)."""
    return EvalSampler(corpus.val, cfg.seq_len, cfg.microbatch_size, count)


def tokenizer_sha256(corpus: PreparedCorpus) -> str:
    """sha256 of the tokenizer the corpus was made with ("" when unknown: foreign ids without one)."""
    return corpus.tokenizer_sha256 or ""


def check_vocab(corpus: PreparedCorpus, model_vocab_size: int) -> None:
    """Raise ValueError unless ``model_vocab_size`` is 0 (take the tokenizer's) or covers every token id."""
    check_model_vocab(corpus.vocab_size, model_vocab_size)


def check_model_vocab(vocab_size: int, model_vocab_size: int) -> None:
    """Raise ValueError unless ``model_vocab_size`` is 0 (take the tokenizer's) or at least ``vocab_size``."""
    if model_vocab_size != 0 and model_vocab_size < vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {vocab_size} tokens but model.vocab_size = "
            f"{model_vocab_size}; set model.vocab_size = 0 (from the tokenizer) or >= {vocab_size}"
        )


def text_vocab_size(cfg: DataConfig) -> int | None:
    """The vocabulary text will be tokenized with, known before it is (which is slow): ``data.tokenizer``'s, or
    ``data.vocab_size`` for the BPE trained on it; None for prepared data (its vocabulary is its own).

    Raises:
        ValueError: ``data.tokenizer`` is missing or is not a tokenizers JSON file.
    """
    if is_prepared(cfg):
        return None
    tokenizer_file = user_tokenizer_file(cfg)
    if tokenizer_file is None:
        return cfg.vocab_size
    from unbroken.data.tokenizer import read_tokenizer

    return read_tokenizer(tokenizer_file).get_vocab_size()


def _check_windows(cfg: DataConfig, corpus: PreparedCorpus) -> None:
    for name, tokens, fix in (
        ("training", corpus.train, "or use more text"),
        ("validation", corpus.val, "or raise data.val_fraction"),
    ):
        count = num_windows(len(tokens), cfg.seq_len)
        if count < cfg.microbatch_size:
            raise ValueError(
                f"data.source = {cfg.source!r}: the {name} split has {len(tokens)} tokens = {count} windows "
                f"of data.seq_len + 1 = {cfg.seq_len + 1} tokens, fewer than data.microbatch_size = "
                f"{cfg.microbatch_size}; lower data.seq_len or data.microbatch_size, {fix}"
            )
