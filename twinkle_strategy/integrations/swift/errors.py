"""The swift plugin's own error: it speaks swift's language (flags such as ``--sequence_parallel_size``, the
``TWINKLE_*`` variables and the ``--fsdp`` JSON), so it lives with the front-end, not in the library's
:mod:`twinkle_strategy.errors`. A subclass of the library's TwinkleError, so one ``except TwinkleError`` still
catches it."""

from __future__ import annotations

from twinkle_strategy.errors import TwinkleError


class SwiftPluginError(TwinkleError):
    """A swift argument or strategy option that the twinkle plugin cannot serve; says what to change."""
