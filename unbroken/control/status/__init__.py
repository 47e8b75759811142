"""What a run shows: its live model, the status page and its server, the terminal view, the console progress and
summary, alerts, TensorBoard."""
