"""The built-in trainer: a pure LLaMA, its data, and the training loop run by ``unbroken train``."""
