"""Refusals the twinkle plugin makes while ms-swift parses its arguments, several in one process (one start-up).

``python swift_refusals.py CASES_JSON``: CASES_JSON is a list of ``{"name", "argv", "env"}``; for each, with ``env``
set, ``swift sft``'s own entry point (``sft_main``) parses ``argv`` as ``swift sft argv`` would, in this process.
Prints ``=== case NAME`` and then that case's output (swift's log lines and the traceback it ended with), and
``=== exit NAME 0|1`` (1: it raised). Run with the swift virtualenv's interpreter; a case that does not refuse
trains, so the cases are ones that must refuse before any weight is read.
"""

import json
import os
import sys
import traceback


def main() -> None:
    from swift.pipelines import sft_main

    for case in json.loads(sys.argv[1]):
        print(f"=== case {case['name']}", flush=True)
        saved = {k: os.environ.get(k) for k in case["env"]}
        os.environ.update(case["env"])
        try:
            sft_main(case["argv"])
            code = 0
        except BaseException:  # noqa: BLE001 - the refusal is the case's result
            traceback.print_exc(file=sys.stdout)
            code = 1
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        print(f"=== exit {case['name']} {code}", flush=True)


if __name__ == "__main__":
    main()
