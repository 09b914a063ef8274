"""The `keras-dist` command (also `python -m keras_dist`)."""

from __future__ import annotations

import argparse
import json
import sys


def _devices(arguments: argparse.Namespace) -> int:
    import keras_dist  # noqa: PLC0415  (after argument parsing: imports the backend)
    from keras_dist.backends import get_adapter  # noqa: PLC0415

    keras_dist.initialize()
    adapter = get_adapter()
    report = {
        "backend": adapter.name,
        "num_processes": keras_dist.num_processes(),
        "process_id": keras_dist.process_id(),
        "local_device_count": adapter.local_device_count(),
        "devices": keras_dist.list_devices(),
    }
    if arguments.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


def _launch(arguments: argparse.Namespace) -> int:
    raise NotImplementedError(
        "`keras-dist launch` is not implemented yet. Start one process per rank "
        "with KERAS_DISTRIBUTION_JOB_ADDRESSES, KERAS_DISTRIBUTION_NUM_PROCESSES "
        "and KERAS_DISTRIBUTION_PROCESS_ID set, and call keras_dist.initialize()."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dist", description="Distributed training for Keras 3 models."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    devices = commands.add_parser(
        "devices", help="print the backend, processes and devices this process sees"
    )
    devices.add_argument("--json", action="store_true", help="one JSON object")
    devices.set_defaults(handler=_devices)
    launch = commands.add_parser("launch", help="start a multi-process job (not yet)")
    launch.add_argument("--nproc-per-node", type=int, required=True)
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    launch.set_defaults(handler=_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        return arguments.handler(arguments)
    except NotImplementedError as error:
        print(f"keras-dist: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
