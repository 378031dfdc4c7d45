"""The training application's own errors: recipes and command lines, datasets, checks before launch, a stopped
run. The library's are in :mod:`twinkle_strategy.errors`; these subclass its TwinkleError, so one
``except TwinkleError`` catches both."""

from __future__ import annotations

from twinkle_strategy.errors import TwinkleError


class RecipeError(TwinkleError):
    """A recipe or command line that cannot run; ``key`` (when known) is the recipe key to fix."""

    def __init__(self, message: str, *, key: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.key = key
        self.reason = reason if reason is not None else message


class PreflightError(RecipeError):
    """A recipe value that cannot work on this machine; ``key`` is the recipe key to fix."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}", key=key, reason=reason)


class DatasetError(TwinkleError):
    """A dataset file or row that cannot be used; names the file and line."""


class RowError(DatasetError):
    """Why one row cannot become a training example (the caller adds where it is)."""


class RunStoppedError(TwinkleError):
    """``twinkle-sft`` was stopped by SIGTERM or SIGINT (``signum``) during a launched run; every process of it ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
