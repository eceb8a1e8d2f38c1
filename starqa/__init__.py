"""starqa: ask questions about long documents with Star Attention on torchrun workers."""

__version__ = "0.1.0"
