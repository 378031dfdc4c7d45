"""ms-swift's console script (``swift``, i.e. ``swift.cli.main.cli_main``) with ``sft``'s rank program replaced by
tests/workers/swift_sft_rank.py, which forks each rank from the suite's preload server (tests/preload.py, swift_command).

    python tests/workers/swift_cli.py sft ARGS...      # as `swift sft ARGS...`, with the same environment
"""

import importlib.util
import os

from swift.cli.main import ROUTE_MAPPING, cli_main

if __name__ == "__main__":
    # The rank script learns swift's own rank program from here: finding it there would import swift (seconds).
    os.environ["TWINKLE_SWIFT_RANK_PROGRAM"] = importlib.util.find_spec(ROUTE_MAPPING["sft"]).origin
    # cli_main finds the rank program by module name: this folder is sys.path[0], as this file runs as a script
    cli_main({**ROUTE_MAPPING, "sft": "swift_sft_rank"})
