"""The declaration of an :class:`Internal` and the list of those declared (see the package docstring)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata

from twinkle_strategy.errors import InternalChangedError

_REGISTRY: dict[str, Internal] = {}
_WRAPPERS: dict[str, list[str]] = {}


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private attribute, function or class of another library that twinkle_strategy uses."""

    name: str  # as the owner spells it: "PreTrainedModel._get_dtype_plan"
    owner: str  # the distribution it belongs to: "transformers", "accelerate" or "torch"
    used_for: str  # what twinkle_strategy uses it for, as the end of "twinkle_strategy uses it to ..."
    checked: str  # the owner's versions it was checked on
    replacement: str  # the public API that would replace it, or why there is none

    def __post_init__(self):
        if _REGISTRY.setdefault(self.name, self) is not self:
            raise AssertionError(f"internal {self.name} is declared twice")

    @property
    def wrappers(self) -> tuple[str, ...]:
        """The functions of twinkle_strategy.compat that use it."""
        return tuple(_WRAPPERS.get(self.name, ()))

    def installed_version(self) -> str:
        try:
            return importlib.metadata.version(self.owner)
        except importlib.metadata.PackageNotFoundError:
            return "(not installed)"

    def summary(self) -> str:
        return (f"twinkle_strategy uses it to {self.used_for} (checked on {self.owner} {self.checked}; public "
                f"replacement: {self.replacement})")

    def changed(self, what: str = "is gone") -> InternalChangedError:
        """The error a wrapper raises when the installed version no longer has it."""
        return InternalChangedError(
            f"{self.owner} {self.installed_version()}: {self.name} {what}; {self.summary()}. "
            f"Install a {self.owner} version in the range twinkle_strategy declares (setup.py)")

    def wrapper(self, function):
        """Decorator: ``function`` reads this internal; its docstring gets the versions and the replacement."""
        _WRAPPERS.setdefault(self.name, []).append(function.__name__)
        note = (f"Internal: {self.owner} ``{self.name}``, checked on {self.checked}. "
                f"Public replacement: {self.replacement}.")
        function.__doc__ = f"{(function.__doc__ or '').rstrip()}\n\n    {note}\n"
        return function

    def attribute(self, obj, attr: str):
        """``getattr(obj, attr)``, or :meth:`changed` if the installed version no longer has it."""
        try:
            return getattr(obj, attr)
        except AttributeError:
            raise self.changed() from None

    def import_name(self, module: str, attr: str | None = None):
        """``module`` (or its ``attr``), imported, or :meth:`changed` if the installed version no longer has it."""
        try:
            found = importlib.import_module(module)
            return found if attr is None else getattr(found, attr)
        except (ImportError, AttributeError):
            raise self.changed() from None


def declared() -> tuple[Internal, ...]:
    """Every internal declared so far, in declaration order."""
    return tuple(_REGISTRY.values())
