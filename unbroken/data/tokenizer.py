"""Tokenizers for prepared data and the text cache: finding one, training one, and what the data records of it.

Owns turning a ``--tokenizer`` argument (a ``tokenizer.json`` path, a folder holding one, or the name of a
Hugging Face tokenizer already in the local cache) into a ``tokenizers.Tokenizer``; training a byte-level
BPE on a bounded stream of text (``unbroken prepare``'s sample, or the text cache's training split); the
end-of-text id put after every document; the token id type (uint16 when every id fits, else uint32); and the
tokenizer's fingerprint (sha256 of its canonical JSON), which prepared shards record so a reader can refuse a
different tokenizer. It reads no corpus and writes no shards.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
# End-of-text tokens looked up, in this order, when --eot is not given.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
ID_TYPES = ("auto", "uint16", "uint32")
_HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and what prepared data records of it.

    Attributes:
        tokenizer: the tokenizer (truncation and padding off).
        json: its canonical JSON (``Tokenizer.to_str()``), written as ``tokenizer.json`` next to the shards.
        sha256: sha256 of ``json``: equal for the same tokenizer however its file was formatted.
        vocab_size: ids are in ``[0, vocab_size)`` (the largest id + 1 where ids have gaps).
        eot_id: the end-of-text id appended to every document.
        description: where it came from, for logs and the index.
    """

    tokenizer: Tokenizer
    json: str
    sha256: str
    vocab_size: int
    eot_id: int
    description: str


def fingerprint(tokenizer_json: str) -> str:
    """The sha256 (hex) of a tokenizer's canonical JSON."""
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


def find_tokenizer_file(spec: str, hf_cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """Resolve ``spec`` to a ``tokenizer.json`` on disk; returns (path, description).

    ``spec`` is a ``tokenizer.json`` path, a folder holding ``tokenizer.json`` (a saved Hugging Face
    tokenizer), or a Hugging Face name (``gpt2``, ``org/name``) found in the local cache (``hf_cache_dir``,
    else ``HF_HUB_CACHE`` / ``HF_HOME``). Nothing is downloaded.

    Raises:
        ValueError: none of these exists.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve(), f"tokenizer file {path}"
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return (path / "tokenizer.json").resolve(), f"tokenizer folder {path}"
        raise ValueError(f"--tokenizer {spec}: the folder has no tokenizer.json; give a tokenizer.json or its folder")
    if _HF_NAME.match(spec):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "tokenizer.json", cache_dir=hf_cache_dir)
        if isinstance(found, str) and Path(found).is_file():
            return Path(found), f"Hugging Face tokenizer {spec} (local cache)"
        from huggingface_hub import constants

        where = hf_cache_dir or constants.HF_HUB_CACHE
        raise ValueError(
            f"--tokenizer {spec} is not a file, and no Hugging Face tokenizer {spec!r} with a tokenizer.json is in "
            f"the local cache {where} (nothing is downloaded); give a tokenizer.json path, or fetch it first with "
            f"`huggingface-cli download {spec} tokenizer.json`"
        )
    raise ValueError(
        f"--tokenizer {spec} does not exist; give a tokenizer.json, its folder or a cached Hugging Face name"
    )


def load_tokenizer(spec: str, eot: str = "", hf_cache_dir: str | os.PathLike[str] | None = None) -> TokenizerInfo:
    """Load the tokenizer ``spec`` names (see ``find_tokenizer_file``).

    Args:
        spec: a tokenizer.json path, its folder or a cached Hugging Face name.
        eot: the end-of-text token; "" looks up ``EOT_CANDIDATES`` in order.
        hf_cache_dir: the Hugging Face hub cache to look in (default: the environment's).

    Raises:
        ValueError: not found, not a tokenizers JSON file, or no end-of-text token.
    """
    path, description = find_tokenizer_file(spec, hf_cache_dir)
    return describe(read_tokenizer(path), eot, description)


def read_tokenizer(path: Path) -> Tokenizer:
    """``Tokenizer.from_file(path)`` with truncation and padding off.

    Raises:
        ValueError: not a tokenizers JSON file (one line).
    """
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"tokenizer {path} is not a readable tokenizers JSON file ({reason}); "
            "give a tokenizer.json saved by the tokenizers library"
        ) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """Ids are below this: the vocabulary size, or the largest id + 1 where ids have gaps."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)


def describe(tokenizer: Tokenizer, eot: str, description: str) -> TokenizerInfo:
    """Wrap a tokenizer: its canonical JSON, fingerprint, vocabulary size and end-of-text id.

    Raises:
        ValueError: the tokenizer has no end-of-text token (``eot`` or one of ``EOT_CANDIDATES``).
    """
    tokenizer.no_truncation()
    tokenizer.no_padding()
    text = tokenizer.to_str()
    token_id = find_eot(tokenizer, eot)
    if token_id is None:
        raise ValueError(
            f"{description} has no end-of-text token {' or '.join((eot,) if eot else EOT_CANDIDATES)}; "
            "name the token that ends a document with --eot"
        )
    return TokenizerInfo(tokenizer, text, fingerprint(text), vocab_size_of(tokenizer), token_id, description)


def find_eot(tokenizer: Tokenizer, eot: str = "") -> int | None:
    """The id of the end-of-text token ``eot`` ("": the first of ``EOT_CANDIDATES`` the tokenizer has), or None."""
    for token in (eot,) if eot else EOT_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids (``EOT`` included) trained on ``texts``.

    Memory grows with the distinct words of ``texts``, so pass a bounded sample, not a corpus.
    """
    if not 257 <= vocab_size <= 2**20:
        raise ValueError(f"--vocab-size = {vocab_size} must be in [257, 1048576] (256 byte tokens + end-of-text)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def id_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """The token id type: uint16 when every id is below 2**16 (``auto``), else uint32.

    Raises:
        ValueError: ``requested`` is not one of ``ID_TYPES``, or the vocabulary does not fit it.
    """
    if requested not in ID_TYPES:
        raise ValueError(f"--dtype {requested} is not allowed; allowed: {', '.join(ID_TYPES)}")
    if requested == "auto":
        requested = "uint16" if vocab_size <= 2**16 else "uint32"
    dtype = np.dtype(requested)
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ValueError(
            f"the vocabulary has {vocab_size} ids, more than {requested} holds (ids up to {np.iinfo(dtype).max}); "
            "use --dtype uint32 (or auto)"
        )
    return dtype
