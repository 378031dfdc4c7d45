"""What every wrapper of transformers shares: the versions it was checked on, the words for "no public API",
and the check that ``PreTrainedModel`` still declares a class attribute read with a default.
"""

from __future__ import annotations

import functools

from twinkle_strategy.compat.registry import Internal

LOADING_MODULE = "transformers.core_model_loading"
CHECKED = "5.19, 5.23, 5.24"  # the versions each wrapper was checked on, unless it says otherwise
NO_PUBLIC_API = "none (transformers 5.24 has no public API for it)"


def require_on_pretrained_model(entry: Internal, attr: str) -> None:
    """Raise ``entry.changed()`` if transformers' ``PreTrainedModel`` no longer declares class attribute ``attr``
    (read from instances with a default, its absence would otherwise pass unnoticed)."""
    if not _declared_by_pretrained_model(attr):
        raise entry.changed()


@functools.cache
def _declared_by_pretrained_model(attr: str) -> bool:
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, attr)
