"""Tokenizing pieces of text into token ids: the work ``unbroken prepare`` hands to each process, and the text
cache of ``unbroken train`` does in its own.

Owns one function of text to ids, ``Encoder.encode``, and its worker-process wrapper (``init_worker`` /
``encode_in_worker``) for a ``ProcessPoolExecutor``. A worker holds only its tokenizer and the task in hand;
it exits by itself if the process that started it dies (a ``kill -9`` of ``unbroken prepare`` leaves no
orphan tokenizing). It reads no files and writes none.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time

import numpy as np
from tokenizers import Tokenizer

_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate (from a JSON escape) is not UTF-8 text


class EncodeError(Exception):
    """Piece ``index`` of a task could not be tokenized (``reason``); the caller names its place."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(index, reason)
        self.index = index
        self.reason = reason


class Encoder:
    """Pieces of text to token ids, with ``eot_id`` after the last piece of each document.

    Args:
        tokenizer: the tokenizer (special tokens such as BOS are not added).
        eot_id: the end-of-text id.
        dtype: the id type of the output (every id must fit it; the caller checked the vocabulary).
        errors: ``strict`` refuses text the tokenizer cannot take (a lone surrogate from a JSON escape);
            ``replace`` replaces such characters with U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, eot_id: int, dtype: np.dtype, errors: str = "strict") -> None:
        self.tokenizer = tokenizer
        self.eot_id = eot_id
        self.dtype = np.dtype(dtype)
        self.errors = errors
        # encode_batch_fast (tokenizers >= 0.20) gives the same ids without computing character offsets.
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode(self, texts: list[str], ends_doc: list[bool]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, lengths): the ids of every piece, concatenated, and the length of each piece's ids
        (its end-of-text id included)."""
        try:
            encodings = self._encode_batch(texts, add_special_tokens=False)
        except Exception:  # the Rust side raises bare exceptions; find the piece and say what it is
            encodings = [self._encode_one(i, text) for i, text in enumerate(texts)]
        ids = [e.ids for e in encodings]
        lengths = np.fromiter((len(x) + end for x, end in zip(ids, ends_doc, strict=True)), np.int64, len(ids))
        chained = itertools.chain.from_iterable(
            x + [self.eot_id] if end else x for x, end in zip(ids, ends_doc, strict=True)
        )
        tokens = np.fromiter(chained, self.dtype, int(lengths.sum()))
        return tokens, lengths

    def _encode_one(self, index: int, text: str) -> object:
        try:
            return self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:
            if self.errors == "replace":
                clean = _SURROGATE.sub("\ufffd", text)
                return self.tokenizer.encode(clean, add_special_tokens=False)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise EncodeError(index, reason) from None


_ENCODER: Encoder | None = None


def init_worker(tokenizer_json: str, eot_id: int, dtype: str, errors: str) -> None:
    """``ProcessPoolExecutor`` initializer: load the tokenizer once per worker, one thread each."""
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core: no thread pool inside each
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it stops the pool)
    _ENCODER = Encoder(Tokenizer.from_str(tokenizer_json), eot_id, np.dtype(dtype), errors)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def encode_in_worker(texts: list[str], ends_doc: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """``Encoder.encode`` with the worker's encoder."""
    assert _ENCODER is not None, "init_worker was not called"
    return _ENCODER.encode(texts, ends_doc)


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)
