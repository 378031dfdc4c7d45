"""Exit 0 when this interpreter's installed distributions are exactly the pins of the given constraints files.

    python scripts/venv_current.py constraints.txt        # run with the virtualenv's python

Reads only package metadata (no imports of torch or transformers): a fraction of a second. A pin without a
local label (torch==2.13.0) accepts an installed build that has one (2.13.0+cpu), as pip does. Prints each
difference on stderr. Used by scripts/_env.sh and scripts/_venvs.sh to skip pip when nothing changed.
"""

import re
import sys
from importlib import metadata


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str) -> dict[str, str]:
    found = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, sep, version = line.partition("==")
                if not sep:
                    sys.exit(f"{path}: not a name==version pin: {line!r}")
                found[normalize(name)] = version.strip()
    return found


def main() -> int:
    wanted = {}
    for path in sys.argv[1:]:
        wanted.update(pins(path))
    installed = {normalize(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    differences = []
    for name, version in sorted(wanted.items()):
        have = installed.get(name)
        if have is None or (have != version and ("+" in version or have.split("+")[0] != version)):
            differences.append(f"{name}: want {version}, have {have or 'nothing'}")
    for line in differences:
        print(f"venv_current: {line}", file=sys.stderr)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
