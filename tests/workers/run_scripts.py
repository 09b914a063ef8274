"""Several scripts run one after the other in one job (one start-up: CI's
time), each as `python SCRIPT ARGS...` runs it: as `__main__`, with its own
`sys.argv`, from a cleared Keras session (its models and layers named as in a
process of its own). A script's own `kd.initialize()` joins the job the first
time and finds it joined after.

Usage: keras-dist launch --nproc-per-node 2 run_scripts.py "SCRIPT ARGS..." ...
    (each script's command line in one argument, split as a shell would)

Before script i, every process prints `script run i`.
"""

from __future__ import annotations

import os
import runpy
import shlex
import sys


def main() -> None:
    for index, command in enumerate(sys.argv[1:]):
        script, *arguments = shlex.split(command)
        if "keras" in sys.modules:
            sys.modules["keras"].backend.clear_session()
        sys.stdout.flush()  # the last script's lines before this one's mark
        print(f"script run {index}", flush=True)
        sys.argv = [script, *arguments]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as done:
            if done.code not in (None, 0):
                raise
        sys.stdout.flush()


if __name__ == "__main__":
    main()
