"""The errors a backend raises besides its runtime's own.

A module of their own, below `backends.base` and `backends.model_info`: both raise them, and
`base` names `ModelInfo` in its types, so keeping them in `base` made the two import each
other.
"""

from __future__ import annotations


class ModelError(ValueError):
    """A model file that cannot be used; the message names the file and what is wrong."""


class InputError(ValueError):
    """An input of the wrong name, shape or dtype; the message names the input."""


class BackendError(RuntimeError):
    """The runtime failed on a model it had loaded (not the caller's fault)."""


class OptionError(ValueError):
    """A backend option that cannot be used: `key` is the option (empty for the whole
    table), the message says why."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
