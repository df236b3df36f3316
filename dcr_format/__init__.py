"""dcr-format: bit-exact delta refit of model weights through object storage."""

from dcr_format.errors import *  # noqa: F403
from dcr_format.errors import __all__ as _error_names

__version__ = "0.1.0"

__all__ = [*_error_names, "__version__"]
