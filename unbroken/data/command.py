"""The command line of ``unbroken prepare``: its flags, and running it with one summary line.

Owns turning ``argv`` into ``PrepareOptions`` (``add_arguments``, ``options_from_args``), running the
preparation and printing its summary (``run_prepare``, which ``unbroken/cli.py`` calls for its ``prepare``
subcommand), and ``python -m unbroken.data.command`` (``main``). A ``ValueError`` (bad input) becomes
``unbroken: error: <one line>`` and exit status 2. The preparation itself belongs to ``prepare``.
"""

from __future__ import annotations

import argparse
import re
import sys

from unbroken.core.ending import run_then_exit
from unbroken.data.prepare import FORMATS, PrepareOptions, prepare
from unbroken.data.progress import MODES
from unbroken.data.shards import DEFAULT_SHARD_TOKENS
from unbroken.data.sources import ERRORS
from unbroken.data.tokenizer import ID_TYPES

EXIT_USAGE = 2
DESCRIPTION = "Tokenize a corpus once, in parallel, into shards training reads in place."
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"200M"`` -> 209715200 (K, M, G, T are powers of 1024; a plain number is bytes)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"size {text!r} is not a number of bytes; allowed: e.g. 1000000, 500K, 200M, 2G")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``unbroken prepare`` (cli.py adds them to its ``prepare`` subparser)."""
    parser.add_argument(
        "sources", nargs="+", metavar="SRC", help="text/JSONL/parquet files, folders, globs, datasets folders"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (new, empty, or an earlier run's)")
    tok = parser.add_argument_group("tokenizer (one of)")
    tok.add_argument("--tokenizer", default="", metavar="T", help="tokenizer.json, its folder, or a cached HF name")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on a sample of SRC")
    tok.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained BPE (default 8192)")
    tok.add_argument(
        "--sample-bytes", default="64M", help="text the BPE is trained on, e.g. 500K, 64M, 1G (default 64M)"
    )
    tok.add_argument("--eot", default="", help="end-of-text token (default: <|endoftext|>, </s>, ... whichever exists)")
    parser.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    parser.add_argument("--column", default="text", help="parquet / datasets column holding the text (default text)")
    parser.add_argument("--procs", type=int, default=0, help="tokenizing processes (default: one per core)")
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help=f"ids per shard (default {DEFAULT_SHARD_TOKENS})"
    )
    parser.add_argument("--dtype", default="auto", choices=ID_TYPES, help="id type (default: uint16 if it fits)")
    parser.add_argument("--format", default="unbroken", choices=FORMATS, help="output layout (default unbroken)")
    parser.add_argument(
        "--errors",
        default="strict",
        choices=ERRORS,
        help="invalid UTF-8: strict refuses it (default), replace uses U+FFFD",
    )
    parser.add_argument("--progress", default="auto", choices=MODES, help="auto: a bar on a terminal, else lines")


def options_from_args(args: argparse.Namespace) -> PrepareOptions:
    """``PrepareOptions`` from the parsed flags of ``add_arguments``."""
    return PrepareOptions(
        sources=tuple(args.sources),
        out=args.out,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        vocab_size=args.vocab_size,
        sample_bytes=parse_size(args.sample_bytes),
        field=args.field,
        column=args.column,
        procs=args.procs,
        shard_tokens=args.shard_tokens,
        dtype=args.dtype,
        format=args.format,
        errors=args.errors,
        eot=args.eot,
        progress=args.progress,
    )


def run_prepare(args: argparse.Namespace) -> int:
    """``unbroken prepare``: run it and print one summary line; returns the exit status (0).

    Raises:
        ValueError: bad options or bad input (cli.py prints it as one line and exits 2).
    """
    result = prepare(options_from_args(args))
    if result.already_done:
        what = f"{result.out} already holds this preparation (checked)"
    elif result.resumed:
        what = f"continued the preparation in {result.out}"
    else:
        what = f"prepared {result.out}"
    rate = f", {result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s else ""
    print(
        f"{what}: {result.num_docs:,} documents, {result.num_tokens:,} tokens ({result.dtype}, vocabulary "
        f"{result.vocab_size:,}) in {result.num_shards} shards, {result.seconds:.1f} s{rate}",
        flush=True,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unbroken prepare", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m unbroken.data.command``: like ``unbroken prepare``."""
    args = build_parser().parse_args(argv)
    try:
        return run_prepare(args)
    except ValueError as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    run_then_exit(main)
