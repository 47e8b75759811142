"""The shared vocabulary of every layer, pure Python (no torch): the configuration schema, the workload
planner, failure schedules, model sizes, metrics records and logging."""
