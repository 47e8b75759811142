"""The control plane: the coordinator (membership), its authenticated store, the workers' client of it,
and the processes that start and watch workers."""
