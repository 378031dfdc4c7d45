"""One rank of a ``swift sft`` launch whose ranks fork from the suite's preload server (tests/preload.py,
swift_command): the preload client, asked to run ms-swift's own rank program (``swift/cli/sft.py``, named by
tests/workers/swift_cli.py) with this process's arguments. Only the standard library is imported here."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import preload  # noqa: E402 - from tests/, put on the path above

if __name__ == "__main__":
    sys.argv = [preload.__file__, os.environ["TWINKLE_SWIFT_RANK_PROGRAM"], *sys.argv[1:]]
    preload.client()
