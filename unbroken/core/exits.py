"""The exit statuses of a worker process that leaves on purpose.

Owns the numbers a worker exits with when the fault-tolerant layer stops it (``ft.stops.StopRun`` carries them) and
that the host's agent, the launcher and the chaos oracle read back from a process's status. It sits below both
sides, so that the control plane reads an exit without importing the library that chose it.
"""

from __future__ import annotations

EXIT_STOPPED = 3  # this worker left: excluded, cut off, or the job was stopped
EXIT_COORDINATOR_LOST = 4  # the coordinator is gone; the state was checkpointed for --resume
EXIT_INVARIANT = 5  # a check that protects the training state failed; the run stopped, the last checkpoint kept
EXIT_NONFINITE = 6  # a non-finite gradient under train.nonfinite = "stop", or too many consecutive skips
