"""One worker of a torchtitan job under unbroken: from the command line to the Trainer's last step.

``run(argv)``: join the job (``ft.init()``: under ``unbroken launch``, an agent, torchrun or Slurm, the replica's
process group and mesh are formed here), apply the CPU adjustments when this worker trains on the CPU
(``cpu.py``), parse torchtitan's command line (``--module M --config FN`` and its ``--section.key value``
overrides, with torchtitan's own ``ConfigManager``), check and map the settings (``settings.own``), put
unbroken's data in the dataloader slot (``data.py``), build the Trainer (``trainer.py``) and train. A setting the
integration cannot honour ends the worker at start with one line and status 2, as a refused command line does.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import unbroken.ft as ft
from unbroken.integrations.torchtitan import cpu

log = logging.getLogger(__name__)

EXIT_REFUSED = 2  # a setting the integration cannot honour (as the command line's usage errors)
PREFIX = "unbroken.integrations.torchtitan"


def run(argv: list[str]) -> int:
    """One worker of the job (module docstring); returns its exit status."""
    ctx = ft.init()
    if cpu.on_cpu(ctx.device):
        with cpu.importing():
            import torchtitan.trainer  # noqa: F401 - imported once, adjusted
        cpu.after_import()
    try:
        trainer = _trainer(ctx, argv)
    except ValueError as e:
        # stdout: under a launcher, worker 0's lines before the group forms reach its console
        print(f"{PREFIX}: {e}", flush=True)
        log.error("%s", e)
        return EXIT_REFUSED
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


def _trainer(ctx: ft.Context, argv: list[str]) -> Any:
    from torchtitan.config import ConfigManager

    from unbroken.integrations.torchtitan import settings, trainer
    from unbroken.integrations.torchtitan.data import NoTokenizer, UnbrokenData, data_section, torchtitan_tokenizer

    config = ConfigManager().parse_args(list(argv))
    changed = settings.own(config, ctx.config)
    if cpu.on_cpu(ctx.device):
        changed += [f"{line} (CPU)" for line in cpu.adjust_config(config)]
    run = ctx.config
    vocab = config.model_spec.model.vocab_size
    data = data_section(run.data, config.hf_assets_path, vocab)
    config.dataloader = UnbrokenData.Config(
        data=data, microbatches=run.train.microbatches, seed=run.train.seed, vocab_size=vocab
    )
    changed.append(f"dataloader -> unbroken.data (data.source = {data.source}, tokenizer {data.tokenizer or 'BPE'})")
    if torchtitan_tokenizer(config.hf_assets_path) is None:
        config.tokenizer = NoTokenizer.Config()
    for line in changed:
        log.info("%s: %s", PREFIX, line)
    os.environ.setdefault("LOCAL_RANK", str(ctx.device.index or 0))  # torchtitan picks its device by it
    return trainer.build(ctx, config, argv)
