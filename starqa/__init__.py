"""starqa: ask questions about long documents with Star Attention on torchrun workers."""

import starqa.core.hugepages  # noqa: F401  (for its effect: before any import of torch)

__version__ = "0.1.0"
