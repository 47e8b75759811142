"""Hosts of ``unbroken.ft`` for other frameworks' training jobs (a host, like the built-in trainer, ``unbroken.train``).

Each subpackage drives another framework's trainer through the public ``unbroken.ft`` API and imports that
framework; nothing else under ``unbroken`` imports an integration or its framework (``import unbroken`` needs
neither), and ``core``, ``control`` and ``ft`` never import this package.

- ``torchtitan``: a torchtitan job (its model registry, ``parallelize_fn``, optimizer and LR-schedule containers)
  with replicas as the failure domain, in-step recovery, exact mode and rejoin (``pip install unbroken[torchtitan]``).
"""
