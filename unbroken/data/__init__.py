"""Data: ``unbroken prepare``, the text cache of ``unbroken train``, and reading either in place.

Modules, one concern each (``corpus``, ``prepare`` and ``reader`` are the entry points):

- ``corpus``: a ``[data]`` section's corpus and samplers (``open_corpus``, ``train_sampler``, ``eval_sampler``).
- ``textcache``: text for ``unbroken train``, tokenized once into a cache entry (the split, the entry).
- ``prepare``: the preparation: parallel, resumable tokenization into shards.
- ``command``: the ``unbroken prepare`` command line (``run_prepare``, ``add_arguments``).
- ``sources``: naming the input files and streaming their documents in pieces (every text source's reader).
- ``tokenizer``: finding, loading or training the tokenizer; id type; fingerprint.
- ``encode``: text to ids, in a tokenizing process.
- ``shards``: the shard files, the index and the journal of a preparation.
- ``formats``: Megatron-LM / NeMo, nanoGPT and llm.c files, read and written.
- ``export``: a finished preparation converted to one of those layouts.
- ``progress``: the progress bar or lines of a preparation.
- ``stream``: a view of ids across files, read in place (positional reads, or memory maps).
- ``reader``: opening prepared data (any of the formats), checking it, and the train/validation split.
- ``sampler``: deterministic training and validation microbatches.

Nothing here imports torch except ``sampler`` (and ``corpus``, which returns samplers); ``prepare`` runs
without it. Files are sealed (written whole or not at all) by ``core.atomic``.

A training script of its own reads a ``[data]`` section with ``open_corpus`` (prepared data or text, split,
read in place) and ``train_sampler`` / ``eval_sampler`` (``microbatch(step, id)``: a pure function of the
seed, as the built-in trainer reads it); prepared data alone with ``open_prepared``,
``PreparedMicrobatchSampler`` and ``EvalSampler``. All are importable from here (lazily: importing the package
loads neither torch nor numpy).
"""

from typing import Any

_PUBLIC = {
    "open_corpus": "corpus",
    "train_sampler": "corpus",
    "eval_sampler": "corpus",
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
