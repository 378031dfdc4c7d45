"""The versions twinkle-sft runs with against the ranges ``setup.py`` declares tested (README "Tested versions").

``twinkle-sft --version`` prints them one per line; every run prints them in one line before it starts, so a
log of a failed run says whether it ran on a tested set.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import twinkle_strategy

# What twinkle_strategy reads internals of (through compat/): their versions decide whether it works.
CHECKED_PACKAGES = ("torch", "transformers", "peft")
# What the HF Trainer / TRL front-end runs on (--version lists them, with a range where setup.py declares one).
FRONT_END_PACKAGES = ("trl", "accelerate")


@dataclasses.dataclass(frozen=True)
class PackageVersion:
    name: str
    installed: str | None  # None: not installed
    tested: SpecifierSet | None  # None: unknown (this package is on PYTHONPATH, not installed: no metadata)

    @property
    def outside_tested(self) -> bool:
        # A local build label (2.13.0+cpu) is the same release as far as the range goes.
        return self.tested is not None and self.installed is not None and \
            not self.tested.contains(self.installed.split("+")[0], prereleases=True)


def package_versions(names: tuple[str, ...] = CHECKED_PACKAGES, *, extras: bool = False) -> list[PackageVersion]:
    """``names`` as installed, with the range setup.py declares (``extras``: in an extra, e.g. trl in ``test``)."""
    try:
        declared = {Requirement(r).name: Requirement(r).specifier for r in metadata.requires("twinkle_strategy") or []
                    if extras or "extra ==" not in r}
    except metadata.PackageNotFoundError:  # on PYTHONPATH, not installed (the swift env)
        declared = {}
    found = []
    for name in names:
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        found.append(PackageVersion(name=name, installed=installed, tested=declared.get(name)))
    return found


def version_text(versions: list[PackageVersion] | None = None) -> str:
    """``twinkle-sft --version``: this package, then one line per checked package with its tested range."""
    lines = [f"twinkle-sft {twinkle_strategy.__version__}"]
    for v in package_versions() if versions is None else versions:
        tested = f"tested {v.name}{v.tested}" if v.tested is not None else "tested range unknown (package not installed)"
        lines.append(f"  {v.name} {v.installed or 'not installed'} "
                     f"({tested}{'; OUTSIDE the tested range' if v.outside_tested else ''})")
    if versions is None:
        for v in package_versions(FRONT_END_PACKAGES, extras=True):
            tested = f"tested {v.name}{v.tested}" if v.tested is not None else "its range is the one transformers requires"
            lines.append(f"  {v.name} {v.installed or 'not installed'} (HF Trainer / TRL front-end; {tested}"
                         f"{'; OUTSIDE the tested range' if v.outside_tested else ''})")
    return "\n".join(lines)


def startup_line(versions: list[PackageVersion] | None = None) -> str:
    """The same facts in one line, for the start of a run."""
    versions = package_versions() if versions is None else versions
    installed = ", ".join(f"{v.name} {v.installed or 'not installed'}" for v in versions)
    outside = [f"{v.name} {v.installed} is OUTSIDE the tested range {v.name}{v.tested}"
               for v in versions if v.outside_tested]
    if outside:
        verdict = "; ".join(outside)
    elif any(v.tested is None for v in versions):
        verdict = "tested ranges unknown (twinkle_strategy is on PYTHONPATH, not installed)"
    else:
        verdict = "within the tested ranges"
    return f"twinkle-sft {twinkle_strategy.__version__} with {installed}: {verdict} (twinkle-sft --version)"
