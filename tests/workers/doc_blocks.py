"""Run a doc page's python blocks in order, as one script (one namespace), on every rank; record what each did.

    torchrun ... doc_blocks.py BLOCKS_JSON OUT_DIR

``BLOCKS_JSON``: ``[{"line": N, "code": "..."}, ...]`` (tests/multiproc/test_docs_transformers.py extracts them from the page).
Each rank writes ``OUT_DIR/rank<R>.json``: per block, the losses of the trainer it built and trained (if it did).
A block that raises stops the script with its traceback, naming the page line the block starts at.
"""

import json
import math
import os
import sys


def main() -> None:
    blocks_path, out_dir, page = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(blocks_path) as f:
        blocks = json.load(f)
    namespace = {"__name__": "__main__"}
    records = []
    for block in blocks:
        before = namespace.get("trainer")
        exec(compile(block["code"], f"{page} (the block at line {block['line']})", "exec"), namespace)
        trainer = namespace.get("trainer")
        trained = trainer is not None and trainer is not before
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry] if trained else []
        records.append({"line": block["line"], "trained": trained, "losses": losses,
                        "output_dir": os.path.abspath(trainer.args.output_dir) if trained else None,
                        "trainer_class": type(trainer).__mro__[2].__name__ if trained else None})
        assert all(math.isfinite(loss) for loss in losses), records[-1]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "blocks": records}, f)


if __name__ == "__main__":
    main()
