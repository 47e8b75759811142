"""``python -m unbroken`` runs the command line (the launcher starts its processes this way)."""

from unbroken.cli import run

run()
