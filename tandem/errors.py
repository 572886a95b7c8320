"""Typed errors. Every user-facing failure raises one of these before any state changes."""


class TandemError(Exception):
    """Base class of all tandem errors."""


class UnknownModelError(TandemError, KeyError):
    """A model name is neither in the zoo nor a local model directory."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class ModelLoadError(TandemError):
    """A model directory or file is missing, unreadable, corrupt or of an unsupported architecture."""


class ModelFetchError(TandemError):
    """Fetching a zoo model failed (package download, checksum, conversion)."""


class InvalidParameterError(TandemError, ValueError):
    """A parameter (sampling, engine, drafter) is out of range or inconsistent."""


class PromptTooLongError(TandemError, ValueError):
    """A prompt (plus max_tokens) does not fit in the model's context or the KV cache."""


class PolicyUpdateError(InvalidParameterError):
    """New target (policy) weights were refused: unknown name, wrong shape or dtype, non-finite values,
    or requests still running on the old weights. Nothing was changed."""


class UnsteadyMachineError(TandemError):
    """A benchmark row ran while the machine's memory bandwidth moved beyond the tolerance (`--strict-probe`)."""
