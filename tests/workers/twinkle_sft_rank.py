"""What the suite's ``twinkle-sft`` processes run in place of ``python -m twinkle_strategy.train.cli``
(tests/preload.py, cli_command): the CLI's ``main``, with the writer pause a test asks for in ``$TWINKLE_TEST_PAUSE_SAVE_WRITER``
installed in this process (tests/workers/save_writer_pause.py)."""

import sys

from save_writer_pause import pause_from_environment

from twinkle_strategy.train.cli import main

if __name__ == "__main__":
    with pause_from_environment():
        code = main()
    sys.exit(code)
