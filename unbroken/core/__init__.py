"""The shared vocabulary of every layer, pure Python (no torch): the configuration schema, the workload
planner, failure schedules, replica layouts, model sizes, metrics records and the typed reading of a run's
records (``runfacts``), goodput, sealed files and checkpoint files, exit statuses and logging."""
