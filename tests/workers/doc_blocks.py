"""Run doc pages' python blocks, each page in order as one script (its own namespace), on every rank; record what
each block did.

    torchrun ... doc_blocks.py PAGES_JSON OUT_DIR

``PAGES_JSON``: ``[{"page": "docs/x.md", "blocks": [{"line": N, "code": "..."}, ...]}, ...]`` (tests/doc_pages.py
extracts them from the pages). Each rank writes ``OUT_DIR/rank<R>.json``: per page, per block, the log lines of the
trainer it built and trained (if it did). A block that raises stops the script with its traceback, naming the page
and the line the block starts at.
"""

import json
import math
import os
import sys

# What a trained block's log lines keep: the same on every rank (no timings).
LOGGED = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "aux_loss")


def library_class(trainer) -> str:
    """The transformers or TRL class a ``with_strategy(...)`` trainer class was built on."""
    return next(c.__name__ for c in type(trainer).__mro__ if c.__module__.split(".")[0] in ("transformers", "trl"))


def run_page(page: str, blocks: list[dict]) -> list[dict]:
    namespace = {"__name__": "__main__"}
    records = []
    for block in blocks:
        before = namespace.get("trainer")
        exec(compile(block["code"], f"{page} (the block at line {block['line']})", "exec"), namespace)
        trainer = namespace.get("trainer")
        trained = trainer is not None and trainer is not before
        lines = [{k: h[k] for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h] if trained \
            else []
        records.append({"line": block["line"], "trained": trained, "losses": [h["loss"] for h in lines], "log": lines,
                        "output_dir": os.path.abspath(trainer.args.output_dir) if trained else None,
                        "trainer_class": library_class(trainer) if trained else None})
        assert all(math.isfinite(h["loss"]) for h in lines), records[-1]
    return records


def main() -> None:
    pages_path, out_dir = sys.argv[1], sys.argv[2]
    with open(pages_path) as f:
        pages = json.load(f)
    records = {entry["page"]: run_page(entry["page"], entry["blocks"]) for entry in pages}
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pages": records}, f)


if __name__ == "__main__":
    main()
