"""Integrations with other libraries, each imported on demand (the libraries are optional).

- :mod:`moeyard.integrations.transformers`: the transformers experts implementation ``"moeyard"``
  (``register()``, ``moeyard_experts_forward``).
"""
