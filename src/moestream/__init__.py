"""moestream: run giant Mixture-of-Experts language models on a CPU within a RAM budget."""

from .errors import CheckpointError, ConfigError, InputError, IntegrityError, MoeStreamError
from .generate import Model, load

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InputError",
    "IntegrityError",
    "Model",
    "MoeStreamError",
    "__version__",
    "load",
]
