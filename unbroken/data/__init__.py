"""Data at scale: ``unbroken prepare`` and memory-mapped reading of prepared corpora.

Modules, one concern each (``prepare`` and ``reader`` are the entry points):

- ``prepare``: the preparation: parallel, resumable tokenization into shards.
- ``command``: the ``unbroken prepare`` command line (``run_prepare``, ``add_arguments``).
- ``sources``: naming the input files and streaming their documents in pieces.
- ``tokenizer``: finding, loading or training the tokenizer; id type; fingerprint.
- ``encode``: text to ids, in a tokenizing process.
- ``shards``: the shard files, the index and the journal of a preparation.
- ``formats``: Megatron-LM / NeMo, nanoGPT and llm.c files, read and written.
- ``export``: a finished preparation converted to one of those layouts.
- ``progress``: the progress bar or lines of a preparation.
- ``stream``: a view of ids across files, read in place (positional reads, or memory maps).
- ``reader``: opening prepared data (any of the formats), checking it, and the train/validation split.
- ``sampler``: deterministic training and validation microbatches of prepared data.

Nothing here imports torch except ``sampler``; ``prepare`` runs without it.

A training script of its own reads prepared data with ``open_prepared`` (the corpus, split, read in place),
``PreparedMicrobatchSampler`` (``microbatch(step, id)``: a pure function of the seed, as the built-in trainer
reads it) and ``EvalSampler`` (fixed validation microbatches), importable from here (lazily: importing the
package loads neither torch nor numpy).
"""

from typing import Any

_PUBLIC = {
    "open_prepared": "reader",
    "PreparedCorpus": "reader",
    "PreparedMicrobatchSampler": "sampler",
    "EvalSampler": "sampler",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
