"""The `keras-dist` command (also `python -m keras_dist`)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap


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


def _env(arguments: argparse.Namespace) -> int:
    """`keras-dist env`: which cluster environment `keras_dist.initialize()`
    detects here, from which variables, and the job it would join."""
    from keras_dist import cluster, runtime  # noqa: PLC0415

    overrides = {
        name: cluster.environment_value(name)
        for name in (
            runtime.JOB_ADDRESSES_VARIABLE,
            runtime.NUM_PROCESSES_VARIABLE,
            runtime.PROCESS_ID_VARIABLE,
        )
    }
    report: dict[str, object] = {
        "overrides": overrides,
        "tried": cluster.explain_detection(),
        "detected": None,
        "cluster": None,
        "job": None,
    }
    error = None
    try:
        detected = cluster.detect_cluster()
        if detected is not None:
            report["detected"] = type(detected).__name__
            report["cluster"] = {
                "coordinator": detected.coordinator_address(),
                "num_processes": detected.num_processes(),
                "num_processes_from": detected.num_processes_source,
                "process_id": detected.process_id(),
                "process_id_from": detected.process_id_source,
                "local_process_id": detected.local_process_id(),
            }
        coordinator, count, rank = runtime.resolve_cluster()
        report["job"] = {
            "coordinator": coordinator,
            "num_processes": count,
            "process_id": rank,
        }
    except (TypeError, ValueError) as problem:
        error = str(problem)
        report["error"] = error
    if arguments.json:
        print(json.dumps(report))
    else:
        print(_describe_env(report))
    if error is not None:
        print(f"keras-dist env: {error}", file=sys.stderr)
        return 2
    return 0


def _describe_env(report: dict) -> str:
    lines = ["Cluster environments, in the order keras_dist.initialize() tries them:"]
    for number, entry in enumerate(report["tried"], start=1):
        variables = ", ".join(f"{k}={v!r}" for k, v in entry["set"].items())
        if entry["chosen"]:
            state = "DETECTED"
        elif entry["detected"]:
            state = "detected too, not used (an earlier one wins)"
        else:
            state = "not detected"
        lines.append(f"  {number}. {entry['name']}: {state}")
        if entry["detected"] or variables or not entry["reads"]:
            lines += textwrap.wrap(
                entry["summary"], 79, initial_indent="     ", subsequent_indent="     "
            )
        if entry["reads"]:
            lines.append(f"     reads: {', '.join(entry['reads'])}")
        if variables:
            lines.append(f"     set: {variables}")
    cluster_values = report["cluster"]
    if report["detected"] is None:
        lines.append(
            "No cluster environment detected: without KERAS_DISTRIBUTION_* "
            "variables this process runs alone (on JAX, jax.distributed's own "
            "detection is tried first: Cloud TPU, GKE, Open MPI...)."
        )
    elif cluster_values is not None:
        lines += [
            f"Detected: {report['detected']}",
            f"  coordinator: {cluster_values['coordinator']}",
            f"  num_processes: {cluster_values['num_processes']} "
            f"(from {cluster_values['num_processes_from']})",
            f"  process_id: {cluster_values['process_id']} "
            f"(from {cluster_values['process_id_from']})",
            f"  local_process_id: {cluster_values['local_process_id']}",
        ]
    overrides = {k: v for k, v in report["overrides"].items() if v is not None}
    if overrides:
        lines.append(
            "Overrides (win over the cluster): "
            + ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        )
    else:
        lines.append("Overrides (KERAS_DISTRIBUTION_*): none set")
    job = report["job"]
    if job is not None:
        coordinator = job["coordinator"] or "none (one process)"
        lines.append(
            f"Job keras_dist.initialize() joins: {job['num_processes']} "
            f"process(es), this one is process {job['process_id']}, "
            f"coordinator {coordinator}"
        )
    return "\n".join(lines)


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
    env = commands.add_parser(
        "env",
        help="print which cluster environment keras_dist.initialize() detects, "
        "from which variables, and the job it would join",
    )
    env.add_argument("--json", action="store_true", help="one JSON object")
    env.set_defaults(handler=_env)
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
