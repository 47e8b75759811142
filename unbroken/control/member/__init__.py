"""A worker's side of the control plane: its client of the coordinator, the news watch, the host's heartbeat board."""
