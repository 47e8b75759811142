"""unbroken: LLM pre-training on PyTorch that keeps going when machines die."""

__version__ = "0.1.0"
