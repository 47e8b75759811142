"""torchtitan's ``train.py`` under unbroken: a script file for ``unbroken launch`` and ``unbroken agent``.

    unbroken launch --workers 4 --parallel.shard=2 --recovery.reduction=exact \\
        examples/torchtitan_train.py --module llama3 --config llama3_debugmodel --training.seq_len 128

The arguments after the script are torchtitan's; the ones before it unbroken's (docs/torchtitan.md).
"""

import sys

from unbroken.integrations.torchtitan import main

if __name__ == "__main__":
    sys.exit(main())
