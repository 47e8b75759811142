"""``python -m unbroken`` runs the command line (the launcher starts its processes this way)."""

import sys

from unbroken.cli import main

sys.exit(main())
