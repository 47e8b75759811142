"""unbroken as torchtitan's fault-tolerance layer: a torchtitan job under ``unbroken launch`` (docs/torchtitan.md).

A torchtitan user swaps one module on their command line and keeps their config function and overrides::

    torchrun --nproc_per_node 4 -m torchtitan.train --module llama3 --config llama3_debugmodel ...
    unbroken launch --workers 4 --parallel.shard=2 --recovery.reduction=exact \\
        examples/torchtitan_train.py --module llama3 --config llama3_debugmodel ...
    torchrun --nproc_per_node 4 -m unbroken.integrations.torchtitan --module llama3 --config llama3_debugmodel ...

(``examples/torchtitan_train.py`` is ``python -m unbroken.integrations.torchtitan`` as a script file, which
``unbroken launch`` and ``unbroken agent`` take.) torchtitan keeps its model registry, ``parallelize_fn`` (FSDP2
and tensor parallelism inside a replica), optimizer and LR-schedule containers and tokenizer; unbroken adds
replicas as the failure domain, M constant microbatches per step with in-step recovery, exact mode, rejoin with
live state transfer, warm spares, goodput, the status page and the run summary.

Modules: ``job`` (a worker's entry), ``trainer`` (the Trainer subclass), ``settings`` (what each side owns,
and what is refused), ``data`` (unbroken's data in torchtitan's dataloader slot), ``checkpoint`` (to and from
torchtitan's checkpoint layout), ``cpu`` (the adjustments torchtitan 0.3.0 needs on a CPU device). Importing
this package does not import torchtitan: ``pip install unbroken[torchtitan]`` brings it.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """One worker of a torchtitan job under unbroken: ``argv`` is torchtitan's command line (``--module M
    --config FN`` and its overrides); unbroken's keys come from the launcher (or, alone, its defaults)."""
    from unbroken.integrations.torchtitan.job import run

    return run(sys.argv[1:] if argv is None else argv)
