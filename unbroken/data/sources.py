"""Source text for ``unbroken prepare`` and the text cache of ``unbroken train``: naming the input files and
streaming their documents in pieces (the only reader of text, JSONL, parquet and datasets sources).

Owns turning ``SRC...`` arguments (files, globs, folders, JSONL, parquet, ``datasets`` save_to_disk folders,
gzip- or zstd-compressed text and JSONL) into an ordered list of ``Unit``s, checking what can be checked
before anything is written (existence, readability, empty files, parquet and datasets columns), and
streaming each unit as ``Piece``s of at most about ``PIECE_CHARS`` characters, resumable at any
(unit, record, piece). It knows nothing about tokenizers or shards, and it never holds a whole file in memory:
memory is bounded by one JSONL line or one parquet batch.

Documents: a text file is one document; a JSONL line, a parquet row or a datasets row is one document.
Blank lines, null values and documents of whitespace only are skipped. A document longer than
``PIECE_CHARS`` is cut into pieces at a line break between two non-space characters (else at a space between
two non-space characters), where a byte-level pre-tokenizer splits anyway, so the tokens are those of the
whole document; the cut depends only on the text, so a resumed run cuts in the same places.

Encoding: UTF-8. Invalid bytes are refused (``errors="strict"``, the default: a one-line error naming the
file and the byte) or replaced with U+FFFD (``errors="replace"``). A NUL byte in a text file marks it binary
and is always refused. Error messages call the sources and the settings that fix them what ``Names`` says:
the command line's words, or the ``[data]`` section's.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

PIECE_CHARS = 1 << 20  # a document is cut into pieces of about this many characters
READ_BYTES = 1 << 20  # text files are read in blocks of this many bytes
ROWS_PER_BATCH = 1024  # parquet and datasets rows read at a time
ERRORS = ("strict", "replace")
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
ALLOWED = (
    "allowed: text files (.txt/.md, also .gz/.zst), .jsonl files (also .gz/.zst), .parquet files, folders of "
    "these, globs, and folders written by datasets' save_to_disk"
)
_LINE_BREAK = re.compile(r"(?<=\S)\n(?=\S)")
_SPACE_BREAK = re.compile(r"(?<=\S) (?=\S)")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Names:
    """What error messages call the sources and the settings that fix them: ``unbroken prepare``'s command line
    (``CLI``), or ``unbroken train``'s ``[data]`` section (``CONFIG``).

    Attributes:
        source: the sources (``SRC``).
        field: the setting naming the text field of JSONL lines.
        column: the setting naming the text column of parquet files and datasets folders.
        replace: the setting that replaces invalid UTF-8 ("" where there is none).
    """

    source: str = "SRC"
    field: str = "--field"
    column: str = "--column"
    replace: str = "--errors=replace"

    def or_replace(self) -> str:
        """The second way out of invalid UTF-8, after fixing the input ("" where there is none)."""
        return f", or pass {self.replace} to replace invalid bytes with U+FFFD" if self.replace else ""


CLI = Names()
CONFIG = Names("data.source", "data.text_field", "data.text_field", "")


@dataclass(frozen=True)
class Unit:
    """One input read as a whole: a file, or one split of a datasets folder.

    Attributes:
        path: the file (or datasets folder).
        kind: ``text``, ``jsonl``, ``parquet`` or ``datasets``.
        compression: ``""``, ``gzip`` or ``zstd``.
        split: the split of a datasets ``DatasetDict`` folder ("" otherwise).
        size: bytes on disk (what progress counts).
        mtime_ns: last modification, part of the preparation's fingerprint.
    """

    path: str
    kind: str
    compression: str = ""
    split: str = ""
    size: int = 0
    mtime_ns: int = 0

    def describe(self) -> str:
        where = f"{self.path}[{self.split}]" if self.split else self.path
        return f"{self.kind}{'+' + self.compression if self.compression else ''} {where}"

    def identity(self) -> list[Any]:
        return [self.path, self.kind, self.compression, self.split, self.size, self.mtime_ns]


@dataclass(frozen=True)
class Piece:
    """A piece of a document, in source order.

    Attributes:
        unit: index of its unit.
        record: index of its record in the unit (JSONL line, parquet or datasets row; 0 for a text file).
        piece: index of the piece in its document.
        text: the text.
        ends_doc: whether it is the document's last piece (an end-of-text token follows it).
        done_bytes: about how many bytes of the unit (on disk) have been read once this piece is consumed.
    """

    unit: int
    record: int
    piece: int
    text: str
    ends_doc: bool
    done_bytes: int


# ---------------------------------------------------------------------------------------------------------
# Naming the inputs


def resolve_sources(specs: Sequence[str], column: str = "text", names: Names = CLI) -> list[Unit]:
    """The units named by ``specs``, in order (each folder or glob sorted by path); nothing is written. Error
    messages use ``names``.

    Raises:
        ValueError: a spec matches nothing, a file is empty or unreadable, a parquet file or datasets folder
            lacks ``column`` (or it is not text), or nothing usable was named.
    """
    if not specs:
        raise ValueError(f"no {names.source} given; {ALLOWED}")
    units: list[Unit] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir():
            units.extend(_folder_units(path, column, names))
        elif path.is_file():
            units.extend(_file_units(path, column, names, explicit=True))
        elif _GLOB_CHARS.search(spec):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            if not matches:
                raise ValueError(f"{names.source} {spec} matches no file; {ALLOWED}")
            for match in matches:
                p = Path(match)
                units.extend(
                    _folder_units(p, column, names) if p.is_dir() else _file_units(p, column, names, explicit=True)
                )
        else:
            raise ValueError(f"{names.source} {spec} does not exist; {ALLOWED}")
    return units  # (JSONL fields are checked line by line while reading)


def _classify(path: Path) -> tuple[str, str]:
    """(kind, compression) from the file name; kind "" when the suffix is not one we read."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1], "") if suffixes else ""
    if compression:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in JSONL_SUFFIXES:
        return "jsonl", compression
    if last in PARQUET_SUFFIXES and not compression:
        return "parquet", ""
    if last in TEXT_SUFFIXES:
        return "text", compression
    return "", compression


def _file_units(path: Path, column: str, names: Names, explicit: bool) -> list[Unit]:
    kind, compression = _classify(path)
    if not kind:
        if not explicit:
            return []
        kind = "text"  # a file named on the command line is read as text whatever its suffix
    try:
        st = path.stat()
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(
            f"{names.source} file {path} cannot be read ({e.strerror}); every source file must be readable"
        ) from None
    if st.st_size == 0:
        raise ValueError(f"{names.source} file {path} is empty; remove it or name only files that hold text")
    if kind == "parquet":
        _check_parquet(path, column, names)
    return [Unit(str(path.resolve()), kind, compression, "", st.st_size, st.st_mtime_ns)]


def _folder_units(path: Path, column: str, names: Names) -> list[Unit]:
    if any((path / marker).is_file() for marker in DATASETS_MARKERS):
        return _datasets_units(path, column, names)
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    units = [u for p in files for u in _file_units(p, column, names, explicit=False)]
    if not units:
        raise ValueError(f"{names.source} folder {path} holds no file we read; {ALLOWED}")
    return units


def _check_parquet(path: Path, column: str, names: Names) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{names.source} file {path} is not a readable parquet file ({_first_line(e)})") from None
    if column not in schema.names:
        raise ValueError(
            f"{names.source} file {path} has no column {column!r} (columns: {', '.join(schema.names)}); "
            f"set {names.column} to the column holding the text"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(
            f"{names.source} file {path}: column {column!r} is {kind}, not text; {names.column} must name a text column"
        )


def _load_datasets(path: Path, names: Names) -> Any:
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types (FileNotFoundError, ArrowInvalid, ...)
        raise ValueError(
            f"{names.source} {path} cannot be loaded with datasets.load_from_disk "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from None


def _datasets_units(path: Path, column: str, names: Names) -> list[Unit]:
    import datasets

    loaded = _load_datasets(path, names)
    parts = list(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    units = []
    for split, part in parts:
        where = f"{path}[{split}]" if split else str(path)
        if column not in part.column_names:
            raise ValueError(
                f"{names.source} {where} has no column {column!r} (columns: {', '.join(part.column_names)}); "
                f"set {names.column} to the column holding the text"
            )
        dtype = getattr(part.features[column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(f"{names.source} {where}: column {column!r} is {part.features[column]}, not text")
        files = [Path(f["filename"]) for f in part.cache_files]
        size = sum(f.stat().st_size for f in files)
        mtime = max((f.stat().st_mtime_ns for f in files), default=0)
        units.append(Unit(str(path.resolve()), "datasets", "", split, size, mtime))
    return units


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# ---------------------------------------------------------------------------------------------------------
# Streaming the documents


def iter_pieces(
    units: Sequence[Unit],
    field: str = "text",
    column: str = "text",
    errors: str = "strict",
    start: tuple[int, int, int] = (0, 0, 0),
    names: Names = CLI,
) -> Iterator[Piece]:
    """Every piece of every unit, in order, beginning at ``start`` = (unit, record, piece). Error messages use
    ``names``.

    Raises:
        ValueError: unreadable or corrupt data, invalid UTF-8 (with ``errors="strict"``), a JSONL line that
            is not an object with a text ``field``, or a unit with no document at all.
    """
    if errors not in ERRORS:
        raise ValueError(f"--errors {errors} is not allowed; allowed: {', '.join(ERRORS)}")
    first_unit, first_record, first_piece = start
    for u in range(first_unit, len(units)):
        unit = units[u]
        skip = (first_record, first_piece) if u == first_unit else (0, 0)
        produced = skip != (0, 0)
        for piece in _unit_pieces(u, unit, field, column, errors, names, *skip):
            produced = True
            yield piece
        if not produced:
            raise ValueError(f"{names.source} {unit.describe()} holds no text (no document that is not blank)")


def _unit_pieces(
    u: int, unit: Unit, field: str, column: str, errors: str, names: Names, first_record: int, first_piece: int
) -> Iterator[Piece]:
    if unit.kind == "text":
        return _text_pieces(u, unit, errors, names, first_piece)
    if unit.kind == "jsonl":
        records = _jsonl_records(unit, field, errors, names, first_record)
    elif unit.kind == "parquet":
        records = _parquet_records(unit, column, errors, names, first_record)
    else:
        assert unit.kind == "datasets", unit.kind
        records = _datasets_records(unit, column, errors, names, first_record)
    return _document_pieces(u, records, first_record, first_piece)


def _document_pieces(
    u: int, records: Iterator[tuple[int, str, int]], first_record: int, first_piece: int
) -> Iterator[Piece]:
    for record, text, done in records:
        if not text.strip():
            continue
        pieces = split_text(text)
        start = first_piece if record == first_record else 0
        for p in range(start, len(pieces)):
            yield Piece(u, record, p, pieces[p], p == len(pieces) - 1, done)


def next_cut(buffer: str, final: bool, limit: int | None = None) -> int | None:
    """Where the next piece of ``buffer`` ends, or None when more text is needed to decide.

    A function of ``buffer[:4 * limit]`` only (and of whether the text ends there), so reading the text in
    blocks of any size cuts it in the same places. ``limit`` defaults to ``PIECE_CHARS``.
    """
    limit = PIECE_CHARS if limit is None else limit
    if len(buffer) <= limit:
        return len(buffer) if final else None
    if len(buffer) < 4 * limit and not final:
        return None
    end = min(len(buffer), 4 * limit)
    match = _LINE_BREAK.search(buffer, limit, end)
    if match:
        return match.end()
    match = _SPACE_BREAK.search(buffer, limit, end)
    return match.start() if match else limit


def split_text(text: str, limit: int | None = None) -> list[str]:
    """``text`` cut into pieces of about ``limit`` characters (see ``next_cut``; default ``PIECE_CHARS``)."""
    pieces = []
    while True:
        cut = next_cut(text, True, limit)
        assert cut is not None
        pieces.append(text[:cut])
        if cut == len(text):
            return pieces
        text = text[cut:]


def _open_binary(unit: Unit) -> tuple[IO[bytes], Callable[[], int]]:
    """The unit's bytes, decompressed, and a function giving the bytes read from disk so far."""
    raw = open(unit.path, "rb")
    if unit.compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw.tell
    if unit.compression == "zstd":
        import pyarrow as pa

        raw.close()
        native = pa.OSFile(unit.path)
        return io.BufferedReader(pa.CompressedInputStream(native, "zstd"), READ_BYTES), native.tell
    return raw, raw.tell


def _read_error(unit: Unit, e: BaseException, names: Names) -> ValueError:
    what = f"{unit.compression} file" if unit.compression else "file"
    return ValueError(f"{names.source} {unit.path} is not a readable {what} ({_first_line(e)})")


def _text_pieces(u: int, unit: Unit, errors: str, names: Names, first_piece: int) -> Iterator[Piece]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    stream, tell = _open_binary(unit)
    buffer = ""
    offset = 0  # decompressed bytes decoded so far
    p = 0
    with stream:
        while True:
            try:
                block = stream.read(READ_BYTES)
            except (OSError, EOFError) as e:
                raise _read_error(unit, e, names) from None
            final = not block
            nul = block.find(b"\x00")
            if nul != -1:
                raise ValueError(
                    f"{names.source} file {unit.path} is binary (a NUL byte at offset {offset + nul}), not text; "
                    f"{ALLOWED}"
                )
            try:
                text = decoder.decode(block, final)
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{names.source} file {unit.path} is not UTF-8 (invalid byte near offset "
                    f"{offset + max(e.start, 0)}); fix the file{names.or_replace()}"
                ) from None
            offset += len(block)
            if text.startswith("\ufeff") and p == 0 and not buffer:
                text = text[1:]  # a UTF-8 byte order mark is not text
            buffer += text
            while True:
                cut = next_cut(buffer, final)
                if cut is None:
                    break
                piece, buffer = buffer[:cut], buffer[cut:]
                ends = final and not buffer
                if p == 0 and ends and not piece.strip():
                    return  # the whole file is blank: no document
                if p >= first_piece:
                    yield Piece(u, 0, p, piece, ends, tell())
                p += 1
                if ends:
                    return


def _jsonl_records(
    unit: Unit, field: str, errors: str, names: Names, first_record: int
) -> Iterator[tuple[int, str, int]]:
    stream, tell = _open_binary(unit)
    with stream:
        lineno = -1
        while True:
            try:
                line = stream.readline()
            except (OSError, EOFError) as e:
                raise _read_error(unit, e, names) from None
            if not line:
                return
            lineno += 1
            if lineno < first_record or not line.strip():
                continue
            where = f"{names.source} {unit.path} line {lineno + 1}"
            try:
                decoded = line.decode("utf-8", errors)
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where} is not UTF-8 (invalid byte at column {e.start + 1}); fix the file{names.or_replace()}"
                ) from None
            try:
                record = json.loads(decoded)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where} is not valid JSON ({e.msg}); a .jsonl file holds one JSON object per line"
                ) from None
            if not isinstance(record, dict) or field not in record:
                found = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{where} has no field {field!r} (found: {found}); set {names.field} to the field holding the text"
                )
            value = record[field]
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(
                    f"{where}: field {field!r} is {type(value).__name__}, not a string; {names.field} must name text"
                )
            yield lineno, value, tell()


def _decode_values(
    values: list[bytes | None], unit: Unit, column: str, errors: str, names: Names, first_row: int
) -> list[str]:
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append("")
            continue
        try:
            out.append(value.decode("utf-8", errors))
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{names.source} {unit.describe()} row {first_row + i}, column {column!r} is not UTF-8 (invalid "
                f"byte at {e.start}); fix the data{names.or_replace()}"
            ) from None
    return out


def _parquet_records(
    unit: Unit, column: str, errors: str, names: Names, first_record: int
) -> Iterator[tuple[int, str, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(unit.path)
        meta = parquet.metadata
        starts = [0]
        for g in range(meta.num_row_groups):
            starts.append(starts[-1] + meta.row_group(g).num_rows)
        total = max(1, starts[-1])
        first_group = max(0, next((g for g in range(meta.num_row_groups) if starts[g + 1] > first_record), 0))
        row = starts[first_group]
        batches = parquet.iter_batches(
            batch_size=ROWS_PER_BATCH, row_groups=range(first_group, meta.num_row_groups), columns=[column]
        )
        for batch in batches:
            values = batch.column(0).cast(pa.large_binary()).to_pylist()
            texts = _decode_values(values, unit, column, errors, names, row)
            for i, text in enumerate(texts):
                if row + i >= first_record:
                    yield row + i, text, unit.size * (row + i + 1) // total
            row += len(texts)
    except (pa.ArrowException, OSError) as e:
        raise _read_error(unit, e) from None


def _datasets_records(
    unit: Unit, column: str, errors: str, names: Names, first_record: int
) -> Iterator[tuple[int, str, int]]:
    import pyarrow as pa

    loaded = _load_datasets(Path(unit.path), names)
    part = loaded[unit.split] if unit.split else loaded
    table = part.select_columns([column]).with_format("arrow")
    total = max(1, len(table))
    for row in range(first_record, len(table), ROWS_PER_BATCH):
        batch = table[row : row + ROWS_PER_BATCH]
        values = batch.column(0).cast(pa.large_binary()).to_pylist()
        for i, text in enumerate(_decode_values(values, unit, column, errors, names, row)):
            yield row + i, text, unit.size * (row + i + 1) // total


def sample_texts(
    units: Sequence[Unit], sample_bytes: int, field: str = "text", column: str = "text", errors: str = "strict"
) -> Iterator[str]:
    """About ``sample_bytes`` characters of text for training a tokenizer: an equal share from the start of
    every unit, so every file is represented and the sample does not grow with the corpus."""
    if sample_bytes < 1:
        raise ValueError(f"--sample-bytes = {sample_bytes} must be >= 1")
    share = max(1, sample_bytes // max(1, len(units)))
    for u in range(len(units)):
        taken = 0
        for piece in _unit_pieces(u, units[u], field, column, errors, CLI, 0, 0):
            text = piece.text[: share - taken]
            taken += len(text)
            yield text
            if taken >= share:
                break
