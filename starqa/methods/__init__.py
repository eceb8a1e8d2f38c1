"""The Phase 1 methods starqa knows, by name, and their settings: `registry.py` names them
(with each method's own module, the only places a method's name is spelled; tests/
test_layout.py checks), `base.py` is the interface, `config.py` the settings every manifest
records. Everything that depends on the method asks its registry entry, `get(name).…` (see
`Method` in base.py for what can be asked).
"""

from starqa.core.blocks import (ContextBias, context_bias, plan_blocks, plan_file_blocks,
    round_robin, split_contiguous)
from starqa.methods.base import Method
from starqa.methods.config import (MAX_DEFAULT_BLOCK, MIN_BLOCK, OPTIONS, PAST_WINDOW_BLOCK,
    MethodConfig, check_block_size, check_sizes, default_block, fitted_contiguous, fitted_sizes,
    given_settings)
from starqa.methods.registry import (DEFAULT, METHODS, REFERENCE, REGISTRY, get, help_line,
    method_config, owners)

__all__ = ["DEFAULT", "MAX_DEFAULT_BLOCK", "METHODS", "MIN_BLOCK", "OPTIONS",
           "PAST_WINDOW_BLOCK", "REFERENCE", "REGISTRY", "ContextBias", "Method",
           "MethodConfig",
           "check_block_size", "check_sizes", "context_bias",
           "default_block", "fitted_contiguous", "fitted_sizes", "get", "given_settings", "help_line",
           "method_config", "owners",
           "plan_blocks", "plan_file_blocks", "round_robin", "split_contiguous"]
