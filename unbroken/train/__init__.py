"""The built-in trainer: a pure LLaMA (or Hugging Face's), the training loop ``unbroken train`` runs on
``unbroken.ft`` and ``unbroken.data``'s corpus, what a host's workers run (``launch``), and ``unbroken export``."""
