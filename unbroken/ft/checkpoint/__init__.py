"""Checkpoints: the training state's schema and files (schema), and when the protocol writes and loads them (policy)."""
