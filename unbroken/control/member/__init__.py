"""A worker's side of the control plane: its client of the coordinator (``client.CoordinatorClient``, a facade over
the modules here: connections, registration, heartbeat, outbox, watch, job, groups, reconnect), the host's news
relay (``news``) and heartbeat board (``hostbeat``), and the worker's environment (``env``)."""
