"""The versions twinkle-sft runs with: against the ranges ``setup.py`` declares, and the versions the suite ran on
(docs/versions.md).

``twinkle-sft --version`` prints them one per line; every run prints them in one line before it starts, so a
log of a failed run says whether it ran on a tested set. A declared range is wider than what was tested (torch has
no upper bound), so the two are told apart: a version may be allowed and yet untested.
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

# The versions the suite runs on: the pins of constraints.txt (the whole suite), constraints-oldest.txt (the smoke
# subset) and constraints-swift.txt (the swift tests). tests/multiproc/test_first_hour.py checks this against those files.
TESTED_VERSIONS = {
    "torch": ("2.13.0", "2.14.1"),
    "transformers": ("5.19.0", "5.24.0"),
    "peft": ("0.20.0", "0.21.2"),
}


@dataclasses.dataclass(frozen=True)
class PackageVersion:
    name: str
    installed: str | None  # None: not installed
    declared: SpecifierSet | None  # None: unknown (this package is on PYTHONPATH, not installed: no metadata)

    @property
    def outside_declared(self) -> bool:
        # A local build label (2.13.0+cpu) is the same release as far as the range goes.
        return self.declared is not None and self.installed is not None and \
            not self.declared.contains(self.installed.split("+")[0], prereleases=True)

    @property
    def tested(self) -> bool:
        return self.installed is not None and self.installed.split("+")[0] in TESTED_VERSIONS.get(self.name, ())

    def tested_list(self) -> str:
        return ", ".join(TESTED_VERSIONS.get(self.name, ())) or "none"


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
        found.append(PackageVersion(name=name, installed=installed, declared=declared.get(name)))
    return found


def version_text(versions: list[PackageVersion] | None = None) -> str:
    """``twinkle-sft --version``: this package, then one line per checked package: declared range, tested versions."""
    lines = [f"twinkle-sft {twinkle_strategy.__version__}"]
    for v in package_versions() if versions is None else versions:
        declared = f"declared {v.name}{v.declared}" if v.declared is not None else \
            "declared range unknown (package not installed)"
        verdict = "; OUTSIDE the declared range" if v.outside_declared else "" if v.tested else "; not a tested version"
        lines.append(f"  {v.name} {v.installed or 'not installed'} ({declared}; tested {v.tested_list()}{verdict})")
    if versions is None:
        for v in package_versions(FRONT_END_PACKAGES, extras=True):
            declared = f"declared {v.name}{v.declared}" if v.declared is not None else \
                "its range is the one transformers requires"
            lines.append(f"  {v.name} {v.installed or 'not installed'} (HF Trainer / TRL front-end; {declared}"
                         f"{'; OUTSIDE the declared range' if v.outside_declared else ''})")
    return "\n".join(lines)


def startup_line(versions: list[PackageVersion] | None = None) -> str:
    """The same facts in one line, for the start of a run."""
    versions = package_versions() if versions is None else versions
    installed = ", ".join(f"{v.name} {v.installed or 'not installed'}" for v in versions)
    outside = [f"{v.name} {v.installed} is OUTSIDE the declared range {v.name}{v.declared}"
               for v in versions if v.outside_declared]
    untested = [f"{v.name} {v.installed} is not a tested version (tested: {v.tested_list()})"
                for v in versions if not v.tested and not v.outside_declared]
    verdicts = outside + untested
    if any(v.declared is None for v in versions):
        verdicts.append("declared ranges unknown (twinkle_strategy is on PYTHONPATH, not installed)")
    elif not outside:
        verdicts.insert(0, "within the declared ranges")
    if not untested and not outside:
        verdicts.insert(0, "tested versions")
    return f"twinkle-sft {twinkle_strategy.__version__} with {installed}: {'; '.join(verdicts)} (twinkle-sft --version)"
