"""The control plane, by concern: the coordinator (``coordinator``: membership), its authenticated store
(``store``), a worker's client of it (``member``), the processes that start and watch a host's workers (``host``),
what a run shows (``status``), and the single-machine launcher (``launcher``, ``console``, ``launchcheck``)."""
