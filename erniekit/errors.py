"""One exception family so the CLI can print a single line instead of a traceback."""


class ErniekitError(Exception):
    """Base class: the message is one line saying what, where and what to do."""


class ConfigError(ErniekitError):
    """Bad YAML, unknown key, wrong type or impossible combination."""


class DataError(ErniekitError):
    """Unreadable or malformed dataset (the message names file and line)."""


class CheckpointError(ErniekitError):
    """Missing files, missing tensors or shape mismatches in a checkpoint directory."""


class RequestError(ErniekitError, ValueError):
    """A generation input the model cannot take, e.g. a prompt token id outside its vocabulary
    (a ValueError too, as the framework's own error for it was)."""


class NonFiniteError(ErniekitError):
    """The model's logits turned NaN or inf: damaged weights or a float16 overflow."""
