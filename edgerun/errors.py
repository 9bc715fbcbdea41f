"""Errors a user can cause. The CLI prints these without a traceback."""


class EdgerunError(Exception):
    """Base class: the message says what was wrong and what to do."""


class ModelNotFoundError(EdgerunError):
    """A model name or path that does not resolve to weights on disk."""


class ModelFormatError(EdgerunError):
    """A model file that is corrupt, truncated, or not what it claims to be."""


class UnsupportedError(EdgerunError):
    """A valid model that uses something edgerun does not implement yet."""


class ContextOverflowError(EdgerunError):
    """A prompt or generation that does not fit in the context window."""


class InvalidArgumentError(EdgerunError):
    """A bad parameter value (sampling settings, thread counts, ...)."""


class BudgetError(InvalidArgumentError):
    """A memory budget that cannot be met (below the minimum, or unreadable)."""


class DiskSpaceError(EdgerunError):
    """Not enough free space for a file edgerun writes (a model, an offload layout, a pack)."""


class GpuUnavailableError(EdgerunError):
    """A torch device was asked for and cannot be used (torch missing, no CUDA device)."""
