"""Errors raised on bad input. Every message names the problem and the fix."""

from __future__ import annotations


class AdaspecError(ValueError):
    """Base class for user-facing errors (bad arguments, bad models, bad files)."""


class ConfigError(AdaspecError):
    """A generation or policy parameter is out of range."""


class PromptSetChangedError(ConfigError):
    """A distilled set holds responses to prompts whose text has changed since (new material)."""


class PromptError(AdaspecError):
    """The prompt is empty or does not fit the model's context window."""


class VocabularyMismatchError(AdaspecError):
    """A drafter does not share the target's vocabulary."""


class UnknownNameError(AdaspecError):
    """A drafter, policy or model name is not registered."""


class ModelLoadError(AdaspecError):
    """A model could not be found or loaded."""
