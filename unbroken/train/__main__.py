"""``python -m unbroken.train``: one worker of the built-in trainer (started by ``unbroken train``)."""

from unbroken.core.ending import run_then_exit
from unbroken.train.trainer import main

run_then_exit(main)
