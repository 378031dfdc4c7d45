"""One rank of a ``twinkle-sft`` launch whose ranks fork from the suite's preload servers (tests/cli_preload.py):
what ``python -m twinkle_strategy.train.cli ARGS`` runs, as a script the fork server can run."""

import sys

from twinkle_strategy.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
