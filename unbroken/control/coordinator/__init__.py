"""The coordinator: the job's membership loop (``loop.Coordinator``, ``spawn_coordinator``) and its collaborators,
one concern each: admission (``join``), the error judge (``errors``, with the rule of ``bugs``), the watch on the
members (``watch``), the stall judge (``stall``), the fail-slow policy (``slow``, with the detector of
``failslow``), a restarted coordinator's wait (``restore``), the epochs published (``epochs``), the metrics drain
(``drain``) and the stop (``stop``). Import them from their modules: this package imports nothing, so that the
status views may use ``failslow`` without loading the loop."""
