"""Train the tiny model from an hf:// and an ms:// id held in local hub caches, offline, recording what each
rank opens inside those caches.

Two recorders, installed before torch and transformers are imported: an audit hook
(``sys.addaudithook``) sees every file Python opens (config.json, tokenizer files,
checkpoint reads done in Python), and a wrapper around ``safetensors.safe_open`` sees
the weight files safetensors' Rust code opens, which no audit hook sees. The wrapper
only records and calls the real function.
"""

import argparse
import math
import os
import sys

CACHES = [os.path.realpath(os.environ[v]) for v in ("HF_HOME", "MODELSCOPE_CACHE")]
opened: list[str] = []
connections: list[str] = []


def _record_open(path) -> None:
    try:
        path = os.path.abspath(os.fsdecode(path))  # as opened: a Hugging Face snapshot file, not its blob
    except TypeError:  # a file descriptor
        return
    if any(os.path.realpath(path).startswith(cache + os.sep) for cache in CACHES):
        opened.append(path)


def _audit(event, args):
    if event == "open" and args and args[0] is not None:
        _record_open(args[0])
    elif event == "socket.connect":
        connections.append(repr(args[1]))


sys.addaudithook(_audit)

import safetensors  # noqa: E402

_real_safe_open = safetensors.safe_open


def _recording_safe_open(filename, *args, **kwargs):
    _record_open(filename)
    return _real_safe_open(filename, *args, **kwargs)


safetensors.safe_open = _recording_safe_open  # before safetensors.torch and transformers import it

sys.path.insert(0, os.path.dirname(__file__))

import worker_common  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--ids", nargs="+", required=True)
    p.add_argument("--not-loadable", nargs="+", default=[], help="cached ids the checks before launch must refuse")
    args = p.parse_args()
    from twinkle_strategy.train.preflight import PreflightError, check_before_launch
    from twinkle_strategy.train.recipe import load_recipe
    from twinkle_strategy.train.run import build_training

    result = {"runs": {}, "refused": {}}
    for model_id in args.ids:
        recipe = load_recipe(args.recipe, [f"model.path={model_id}", f"data.dataset={args.dataset}",
                                           f"train.output_dir={os.path.join(args.output_dir, model_id[:2])}",
                                           "train.max_steps=2", "train.save_steps=0", "train.logging_steps=1"])
        check_before_launch(recipe)  # the cached snapshot passes the checks made before launch
        opened.clear()
        connections.clear()
        trainer, _ = build_training(recipe)  # the process group stays up for the next id (re-creating it hangs)
        losses = [entry["loss"] for entry in trainer.train()]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
        result["runs"][model_id] = {"losses": losses, "opened": sorted(set(opened)),
                                    "connections": list(connections)}
    for model_id in args.not_loadable:
        try:
            check_before_launch(load_recipe(args.recipe, [f"model.path={model_id}", f"data.dataset={args.dataset}"]))
            result["refused"][model_id] = None
        except PreflightError as exc:
            result["refused"][model_id] = str(exc)
    return result


if __name__ == "__main__":
    worker_common.run(main)
