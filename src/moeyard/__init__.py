"""moeyard: Mixture-of-Experts layers for PyTorch — routing, sync-free dispatch, expert backends
(``loop`` reference, ``bmm_padded``, ``grouped_mm``, ``triton``), and a transformers experts
implementation named ``"moeyard"``.

Importing moeyard registers that experts implementation with transformers (when transformers is
installed); it has no other import-time effect.
"""
from .activations import Activation
from .checks import is_debug, set_debug
from .experts import available_backends, backend_names, experts, get_backend, set_backend

__version__ = "0.1.0"

__all__ = ["Activation", "experts", "available_backends", "backend_names", "get_backend", "set_backend",
           "set_debug", "is_debug", "__version__"]
