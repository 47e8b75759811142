"""``python -m unbroken.train``: one worker of the built-in trainer (started by ``unbroken train``)."""

import sys

from unbroken.train.trainer import main

sys.exit(main())
