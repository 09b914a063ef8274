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
    # The launcher needs only the standard library; the processes it starts
    # import keras and their backend themselves.
    from keras_dist.launcher import LaunchConfig, Launcher  # noqa: PLC0415

    try:
        config = LaunchConfig(
            arguments.script,
            tuple(arguments.script_args),
            nproc_per_node=arguments.nproc_per_node,
            nnodes=arguments.nnodes,
            node_rank=arguments.node_rank,
            coordinator=arguments.coordinator,
            max_restarts=arguments.max_restarts,
            hang_timeout=arguments.hang_timeout,
            grace_period_seconds=arguments.grace_period,
        )
    except (TypeError, ValueError) as error:
        arguments.usage_error(str(error))  # exits with code 2, like argparse
    return Launcher(config).run()


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
    launch = commands.add_parser(
        "launch",
        help="run a script as one job of several processes",
        description=(
            "Start N copies of a Python script on this node with the environment\n"
            "keras_dist.initialize() (and torch) need to form one job. Output lines\n"
            "are prefixed with the rank; when one process fails, the others are\n"
            "stopped. On several nodes, run the same command on each node with its\n"
            "own --node-rank."
        ),
        epilog=(
            "example: keras-dist launch --nproc-per-node 2 train.py --epochs 3\n"
            "         keras-dist launch --nproc-per-node 8 --nnodes 2 --node-rank 0 "
            "--coordinator node0:29500 train.py"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument(
        "--nproc-per-node",
        type=int,
        required=True,
        metavar="N",
        help="processes to start on this node",
    )
    launch.add_argument(
        "--nnodes", type=int, default=1, metavar="M", help="nodes in the job"
    )
    launch.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's index, from 0 to M-1",
    )
    launch.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of node 0 that every node reaches; required when M > 1 "
        "(default on one node: 127.0.0.1 and a free port)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart all processes after a failure, up to K times",
    )
    launch.add_argument(
        "--hang-timeout",
        type=float,
        metavar="S",
        help="when a rank makes no progress for S seconds inside a keras_dist "
        "fit/evaluate/predict, every rank prints its Python stacks, one summary "
        "names the rank(s) behind and the job ends with code 124; 0 turns this "
        "off (default: KERAS_DIST_HANG_TIMEOUT, else 1800)",
    )
    launch.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds stopped processes get between SIGTERM and SIGKILL (a "
        "kd.Checkpoint saves in them when the launcher is stopped); default 10",
    )
    launch.add_argument("script", help="the Python script each process runs")
    launch.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script"
    )
    launch.set_defaults(handler=_launch, usage_error=launch.error)
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
