"""What a run shows: its live model, the status page and its server, the terminal view and its timeline's
sentences, the console progress and summary, alerts, TensorBoard; each reads the run's facts (``core.runfacts``)."""
