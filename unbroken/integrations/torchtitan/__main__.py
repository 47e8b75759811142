"""``python -m unbroken.integrations.torchtitan --module M --config FN [torchtitan overrides]``: one worker."""

import sys

from unbroken.integrations.torchtitan import main

sys.exit(main())
