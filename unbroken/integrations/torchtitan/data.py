"""The job's data under the integration: torchtitan's dataloader slot filled by ``unbroken.data``.

torchtitan's HF dataloader is a stateful stream (each rank reads its share of documents in order, and a
checkpoint holds its position), so a dead rank's microbatches could not be recomputed by another. Under the
integration the microbatch is a pure function of (``train.seed``, step, microbatch id), as in every unbroken
job: the training windows of unbroken's ``[data]`` section (``data.source``: prepared data, read in place, or
text, tokenized once into the cache), ``training.local_batch_size`` sequences of ``training.seq_len`` tokens each
(torchtitan's settings), sampled by ``unbroken.data``'s ``PreparedMicrobatchSampler``.

The tokenizer is torchtitan's: the one under ``hf_assets_path`` (``tokenizer.json``) tokenizes text data, and
prepared data must have been made with it (``unbroken prepare SOURCE --tokenizer HF_ASSETS/tokenizer.json``),
unless ``data.tokenizer`` names another. Without one (torchtitan's wheel ships no ``tests/assets``), text is
tokenized by a byte-level BPE trained on it with the model's vocabulary.

``UnbrokenData`` is a torchtitan ``BaseDataLoader`` (the Trainer builds it where it would build its own, with
its sequence length and batch size); ``NoData`` fills that slot where nothing trains; ``NoTokenizer`` stands in
for torchtitan's tokenizer when its files are absent (the Trainer builds one, the integration never calls it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from unbroken.core.config import DataConfig
from unbroken.data import open_corpus, train_sampler

TOKENIZER_FILE = "tokenizer.json"


def torchtitan_tokenizer(hf_assets_path: str) -> Path | None:
    """torchtitan's tokenizer file under ``hf_assets_path``, if there is one."""
    path = Path(hf_assets_path) / TOKENIZER_FILE
    return path if path.is_file() else None


def data_section(data: DataConfig, hf_assets_path: str, vocab_size: int) -> DataConfig:
    """The ``[data]`` section the job reads: ``data`` with torchtitan's tokenizer when ``data.tokenizer`` names none
    (or, without one, text tokenized with a BPE of the model's vocabulary; prepared data has its own)."""
    if data.tokenizer:
        return data
    tokenizer = torchtitan_tokenizer(hf_assets_path)
    if tokenizer is not None:
        return dataclasses.replace(data, tokenizer=str(tokenizer.resolve()))
    return dataclasses.replace(data, vocab_size=vocab_size)


class UnbrokenData(BaseDataLoader):
    """Microbatch ``j`` of step ``s``: ``microbatch(s, j) -> (inputs, labels)``, each ``(local_batch_size,
    seq_len)`` token ids, the same in every process. Never iterated: the steps are ``unbroken.ft``'s."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        data: DataConfig = field(default_factory=DataConfig)
        """unbroken's ``[data]`` section (``data_section``)"""
        microbatches: int = 8
        """M, the microbatches of a step (``train.microbatches``)"""
        seed: int = 0
        """the data order's seed (``train.seed``)"""
        vocab_size: int = 0
        """the model's vocabulary, which must cover every token id"""

    def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **unused: Any) -> None:
        data = dataclasses.replace(config.data, seq_len=seq_len, microbatch_size=local_batch_size)
        corpus = open_corpus(data)
        if corpus.vocab_size > config.vocab_size:
            raise ValueError(
                f"{corpus.description}: its tokenizer has {corpus.vocab_size} tokens, more than the model's vocabulary "
                f"of {config.vocab_size}; prepare the data with the model's tokenizer (torchtitan's hf_assets_path)"
            )
        self.description = corpus.description
        self.sampler = train_sampler(corpus, data, config.microbatches, config.seed)

    def microbatch(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of microbatch ``microbatch`` of step ``step`` (a pure function of the seed)."""
        inputs, labels = self.sampler.microbatch(step, microbatch)
        return inputs.long(), labels.long()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        raise RuntimeError("the integration's data is read by (step, microbatch id): microbatch(step, id)")

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to save: the position is the step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class NoData(BaseDataLoader):
    """torchtitan's dataloader slot in a process that trains nothing (``checkpoint.py``'s Trainers)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config: Config, **unused: Any) -> None:
        return None

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        raise RuntimeError("no data: this Trainer only reads and writes checkpoints")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class NoTokenizer(BaseTokenizer):
    """torchtitan's tokenizer slot when ``hf_assets_path`` holds none: the data is tokenized already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **unused: Any) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("no tokenizer: torchtitan's hf_assets_path holds none")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError("no tokenizer: torchtitan's hf_assets_path holds none")

    def get_vocab_size(self) -> int:
        return 0
