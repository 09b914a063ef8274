"""The `keras-dist` command (also `python -m keras_dist`)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import textwrap
from typing import Any


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
        # What the engine calls this process' first device: "cpu", or the
        # accelerator's model ("NVIDIA H200", "TPU v5 lite").
        "device_kind": adapter.device_kind(),
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
    from keras_dist import cluster  # noqa: PLC0415
    from keras_dist.cluster import resolve  # noqa: PLC0415

    overrides = {
        name: cluster.environment_value(name)
        for name in (
            resolve.JOB_ADDRESSES_VARIABLE,
            resolve.NUM_PROCESSES_VARIABLE,
            resolve.PROCESS_ID_VARIABLE,
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
        coordinator, count, rank = resolve.resolve_cluster()
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


_MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_memory(text: str) -> int:
    """Bytes from `"16GB"` (powers of 1000), `"16GiB"` (of 1024) or `"1024"`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in _MEMORY_UNITS:
        raise ValueError(
            "--device-memory takes a size such as 16GB, 80GiB or 1024 (bytes). "
            f"Received: {text!r}"
        )
    return int(float(match.group(1)) * _MEMORY_UNITS[unit])


def _import_function(spec: str, flag: str) -> Any:
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"{flag} takes MODULE:FUNCTION. Received: {spec!r}")
    # Like `python -m`: modules in the current directory are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(
            f"{module_name!r} has no function {function_name!r}. Received: "
            f"{flag} {spec!r}"
        )
    return function


def as_flags(message: str, flags: dict[str, str], *, bare_words: bool = False) -> str:
    """`message`, from the Python API, with its argument names said as the
    command's flags: `` `on_indivisible` `` as `` `--on-indivisible` ``,
    `on_indivisible='replicate'` as `--on-indivisible replicate`,
    `coordinator=None` as `no --coordinator`, `batch_size= for` as
    `--batch-size for`; with `bare_words`, also a name alone (`node_rank 0`)
    when it has an underscore (a word only code says). `flags` maps each
    argument to its flag."""
    for name, flag in flags.items():
        message = message.replace(f"`{name}`", f"`{flag}`")
        message = re.sub(rf"\b{name}=None\b", f"no {flag}", message)
        message = re.sub(rf"\b{name}=(?=\s|$)", flag, message)
        message = re.sub(rf"\b{name}='([^']*)'", rf"{flag} \1", message)
        message = re.sub(rf'\b{name}="([^"]*)"', rf"{flag} \1", message)
        message = re.sub(rf"\b{name}=(\S*?)(?=[,;.]?(?:\s|$))", rf"{flag} \1", message)
        if bare_words and "_" in name:
            message = re.sub(rf"(?<![-\w`]){name}\b", flag, message)
    return message


#: The `kd.plan` arguments `keras-dist plan` sets, and their flags.
PLAN_FLAGS = {
    "on_indivisible": "--on-indivisible",
    "input_shape": "--input-shape",
    "sequence_length": "--sequence-length",
    "batch_size": "--batch-size",
    "device_memory": "--device-memory",
    "optimizer": "--optimizer",
    "min_size": "--min-size",
    "layout_map": "--layout-map",
    "sequence_axis": "--sequence-axis",
    "mesh": "--mesh/--axes",
    "topology": "--topology",
    "num_slices": "--num-slices",
    "steps": "--steps",
}
#: The `LaunchConfig` arguments `keras-dist launch` sets, and their flags.
LAUNCH_FLAGS = {
    "nproc_per_node": "--nproc-per-node",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "coordinator": "--coordinator",
    "max_restarts": "--max-restarts",
    "min_nproc": "--min-nproc",
    "min_nnodes": "--nnodes MIN",
    "rdzv_endpoint": "--rdzv-endpoint",
    "node_timeout": "--node-timeout",
    "rdzv_timeout": "--rdzv-timeout",
    "hang_timeout": "--hang-timeout",
    "grace_period_seconds": "--grace-period",
}


def parse_nnodes(text: str) -> tuple[int | None, int]:
    """`--nnodes`: `(None, 2)` from `"2"`, `(1, 2)` from `"1:2"`."""
    low, separator, high = text.partition(":")
    try:
        values = [int(low), int(high)] if separator else [int(low)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--nnodes is a number of nodes (2) or a range MIN:MAX (1:2). "
            f"Received: {text!r}"
        ) from None
    if any(value < 1 for value in values) or values[0] > values[-1]:
        raise argparse.ArgumentTypeError(
            f"--nnodes needs 1 <= MIN <= MAX. Received: {text!r}"
        )
    return (values[0], values[1]) if separator else (None, values[0])


def parse_shape(text: str, flag: str) -> tuple[int | None, ...]:
    """`(32, 32, 3)` from `"32,32,3"`; `None` for `"None"` or `"?"`."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if part in ("None", "none", "?"):
            sizes.append(None)
        elif part.isdigit() and int(part) > 0:
            sizes.append(int(part))
        else:
            raise ValueError(
                f"{flag} takes the shape of one sample without the batch "
                "dimension, sizes separated by commas (None for any size), e.g. "
                f"1024 or 32,32,3 or token_ids=128. Received: {flag} {text!r}"
            )
    return tuple(sizes)


def parse_input_shape(values: list[str] | None) -> Any:
    """`--input-shape 32,32,3` (one input) or, once per input,
    `--input-shape NAME=SHAPE`, as `kd.plan`'s `input_shape`."""
    if not values:
        return None
    named = [value.partition("=") for value in values]
    if len(values) == 1 and not named[0][1]:
        return parse_shape(values[0], "--input-shape")
    if not all(separator for _, separator, _ in named):
        raise ValueError(
            "--input-shape takes one SHAPE, or NAME=SHAPE once per input of a "
            f"model with several. Received: {values}"
        )
    return {
        name.strip(): parse_shape(shape, "--input-shape") for name, _, shape in named
    }


def _plan_mesh(arguments: argparse.Namespace) -> dict[str, int] | None:
    if arguments.mesh is None and arguments.axes is None and arguments.topology:
        return None  # every device of the topology on one axis
    if arguments.mesh is None or arguments.axes is None:
        raise ValueError(
            "--mesh and --axes are needed (with --topology they may both be left "
            "out: every device on one axis). Received: --mesh "
            f"{arguments.mesh!r} --axes {arguments.axes!r}"
        )
    try:
        shape = tuple(int(size) for size in arguments.mesh.split(","))
    except ValueError:
        raise ValueError(
            f"--mesh takes sizes such as 2,4. Received: --mesh {arguments.mesh!r}"
        ) from None
    axes = arguments.axes.split(",")
    if len(axes) != len(shape) or len(set(axes)) != len(axes) or not all(axes):
        raise ValueError(
            "--axes takes one distinct name per size of --mesh, data axis first, "
            f"e.g. batch,model. Received: --mesh {arguments.mesh!r} --axes "
            f"{arguments.axes!r}"
        )
    return dict(zip(axes, shape, strict=True))


def _plan(arguments: argparse.Namespace) -> int:
    """`keras-dist plan`: the planner on a model-building function."""
    from keras_dist import cli_plan  # noqa: PLC0415

    refused = cli_plan.choose_backend(arguments)  # before Keras is imported
    if refused is not None:
        print(f"keras-dist plan: {refused}", file=sys.stderr)
        return 1
    from keras_dist.planner.compiled import UntrainableModelError  # noqa: PLC0415
    from keras_dist.planner.model import UnbuiltModelError  # noqa: PLC0415
    from keras_dist.planner.plan import plan  # noqa: PLC0415

    try:
        memory = None
        if arguments.device_memory is not None:
            memory = parse_memory(arguments.device_memory)
        input_shape = parse_input_shape(arguments.input_shape)
        if arguments.auto:
            from keras_dist import cli_search  # noqa: PLC0415

            model = _import_function(arguments.model, "MODEL")
            return cli_search.run_auto(
                arguments, model, memory, input_shape, lambda e: as_flags(e, PLAN_FLAGS)
            )
        if arguments.search:
            from keras_dist import cli_search  # noqa: PLC0415

            model = _import_function(arguments.model, "MODEL")
            flags = {**PLAN_FLAGS, **cli_search.SEARCH_FLAGS}
            return cli_search.run_search(
                arguments, model, memory, input_shape, lambda e: as_flags(e, flags)
            )
        mesh = _plan_mesh(arguments)
        model = _import_function(arguments.model, "MODEL")
        layout = None
        if arguments.layout_map:
            layout = _import_function(arguments.layout_map, "--layout-map")
        distribution = cli_plan.plan_distribution(arguments, layout)
    except (ImportError, TypeError, ValueError) as error:
        arguments.usage_error(as_flags(str(error), PLAN_FLAGS))  # exits 2
    try:
        result = plan(
            model,
            distribution,
            mesh=mesh,
            input_shape=input_shape,
            sequence_length=arguments.sequence_length,
            batch_size=arguments.batch_size,
            device_memory=memory,
            on_indivisible=arguments.on_indivisible,
            optimizer=arguments.optimizer,
            **_topology_arguments(arguments),
        )
    except (UnbuiltModelError, UntrainableModelError) as error:
        said = (
            cli_plan.unbuilt_words(error, arguments.model)
            if isinstance(error, UnbuiltModelError)
            else cli_plan.untrainable_words(error, arguments.model, search=False)
        )
        print(f"keras-dist plan: {said}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as error:
        print(f"keras-dist plan: {as_flags(str(error), PLAN_FLAGS)}", file=sys.stderr)
        return 1
    # What the plan says to pass, said as this command's flags.
    result.notes = [as_flags(note, PLAN_FLAGS) for note in result.notes]
    for note_list in [result.compiled.notes] if result.compiled else []:
        note_list[:] = [as_flags(note, PLAN_FLAGS) for note in note_list]
    if arguments.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result)
    if arguments.png:
        result.plot(arguments.png)
    if result.problems:
        print(
            f"keras-dist plan: {len(result.problems)} problem(s): "
            + ", ".join(sorted({problem.kind for problem in result.problems})),
            file=sys.stderr,
        )
        return 1
    if result.compiled is not None and result.fits is False:
        print("keras-dist plan: the compiled plan does not fit", file=sys.stderr)
        return 1
    return 0


def _topology_arguments(arguments: argparse.Namespace) -> dict[str, Any]:
    """`kd.plan`'s compiled-plan arguments from `--topology` and its flags."""
    if not arguments.topology:
        return {}
    return {
        "topology": arguments.topology,
        "num_slices": arguments.num_slices,
        "steps": tuple(arguments.steps.split(",")),
    }


def _launch(arguments: argparse.Namespace) -> int:
    # The launcher needs only the standard library; the processes it starts
    # import keras and their backend themselves.
    from keras_dist.cluster.launcher import LaunchConfig, Launcher  # noqa: PLC0415

    try:
        config = LaunchConfig(
            arguments.script,
            tuple(arguments.script_args),
            nproc_per_node=arguments.nproc_per_node,
            nnodes=arguments.nnodes[1],
            min_nnodes=arguments.nnodes[0],
            rdzv_endpoint=arguments.rdzv_endpoint,
            node_timeout=arguments.node_timeout,
            rdzv_timeout=arguments.rdzv_timeout,
            node_rank=arguments.node_rank,
            coordinator=arguments.coordinator,
            max_restarts=arguments.max_restarts,
            hang_timeout=arguments.hang_timeout,
            grace_period_seconds=arguments.grace_period,
            min_nproc=arguments.min_nproc,
        )
    except (TypeError, ValueError, NotImplementedError) as error:
        # exits with code 2, like argparse
        arguments.usage_error(as_flags(str(error), LAUNCH_FLAGS, bare_words=True))
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
    planner = commands.add_parser(
        "plan",
        help="lay a model out on a mesh on paper: each variable's layout, bytes "
        "per device and every problem, from shapes only",
        description=(
            "Build the model that MODULE:FUNCTION returns without allocating it\n"
            "(keras.StatelessScope), lay it out on a mesh of any size (devices this\n"
            "machine lacks get placeholder names) and print each variable's layout\n"
            "and bytes per device, each device's totals and every problem found.\n"
            "A model that is not built (no keras.Input, never called) is built\n"
            "from --input-shape, or refused. With --topology (JAX), also compile\n"
            "the steps fit runs for that topology on abstract values and print\n"
            "XLA's memory, flops and collectives per device, with a projected\n"
            "step time. Exit code 1 when there are problems, the plan is refused\n"
            "or does not fit, 2 for wrong flags."
        ),
        epilog=(
            "examples:\n  keras-dist plan models:llama --mesh 2,4 --axes batch,model "
            "--fsdp --layout-map models:llama_layout --batch-size 8 "
            "--device-memory 16GB --png plan.png\n  keras-dist plan models:llama "
            "--topology v5e-256 --mesh 64,4 --axes batch,model --fsdp "
            "--layout-map models:llama_layout --batch-size 256"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    planner.add_argument(
        "model", metavar="MODULE:FUNCTION", help="a function returning a Keras model"
    )
    planner.add_argument("--mesh", help="mesh shape, e.g. 2,4")
    planner.add_argument(
        "--axes",
        help="mesh axis names, batch axis first, e.g. batch,model",
    )
    planner.add_argument(
        "--topology",
        metavar="NAME",
        help="compile fit's own steps for this topology (JAX): a TPU slice such "
        "as v5e:2x2, v5e-256 or v5p:4x4x8 (needs keras-dist[tpu]), or cpu:N; "
        "--mesh/--axes then default to every device on one axis 'batch'",
    )
    planner.add_argument(
        "--num-slices",
        type=int,
        default=1,
        metavar="N",
        help="TPU slices joined by the data-center network (with --topology)",
    )
    planner.add_argument(
        "--steps",
        default="train,test,predict",
        help="the steps to compile (with --topology), e.g. train",
    )
    planner.add_argument(
        "--fsdp", action="store_true", help="kd.FSDP along the first axis"
    )
    planner.add_argument(
        "--min-size", type=int, default=1024, metavar="N", help="FSDP's min_size"
    )
    planner.add_argument(
        "--sequence-axis",
        metavar="AXIS",
        help="split each sequence along this mesh axis (context parallelism, "
        "JAX), e.g. --mesh 1,8 --axes batch,seq --sequence-axis seq",
    )
    planner.add_argument(
        "--layout-map",
        metavar="MODULE:FUNCTION",
        help="a function of the DeviceMesh returning a LayoutMap (ModelParallel)",
    )
    planner.add_argument(
        "--input-shape",
        action="append",
        metavar="SHAPE",
        help="one sample's shape without the batch dimension, e.g. 1024 or 32,32,3 "
        "(None: any size): builds a model that is not built and sizes the "
        "activation estimate; NAME=SHAPE once per input for several inputs",
    )
    planner.add_argument(
        "--sequence-length",
        type=int,
        metavar="L",
        help="the unknown dimension 1 of the inputs (a KerasHub backbone's "
        "sequence), for the activation estimate",
    )
    planner.add_argument(
        "--batch-size", type=int, metavar="B", help="global batch, for activations"
    )
    planner.add_argument(
        "--device-memory", metavar="SIZE", help="per device, e.g. 16GB or 80GiB"
    )
    planner.add_argument(
        "--optimizer", help="an optimizer name (e.g. adam) whose slots to count"
    )
    planner.add_argument(
        "--on-indivisible",
        choices=("error", "replicate"),
        default="error",
        help="a dimension its mesh axis does not divide: fail (default) or plan "
        "it replicated",
    )
    planner.add_argument("--json", action="store_true", help="one JSON object")
    planner.add_argument("--png", metavar="PATH", help="write a bar chart there")
    from keras_dist.cli_search import add_search_flags  # noqa: PLC0415

    add_search_flags(planner)
    planner.set_defaults(handler=_plan, usage_error=planner.error)
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
        "--nnodes",
        type=parse_nnodes,
        default=(None, 1),
        metavar="M|MIN:MAX",
        help="nodes in the job; MIN:MAX makes it elastic over nodes (with "
        "--rdzv-endpoint): it runs on as many as join, at least MIN, goes on "
        "without a node that is lost and grows back when one joins",
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
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="elastic multi-node: where the nodes meet; the first launcher on "
        "HOST serves the rendezvous there (that node must stay), and it gives "
        "every node its rank and the coordinator",
    )
    launch.add_argument(
        "--node-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="elastic multi-node: a node silent for S seconds is lost; a new "
        "membership waits S seconds for more nodes once MIN joined (default 10)",
    )
    launch.add_argument(
        "--rdzv-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="elastic multi-node: how long a node waits for at least MIN nodes "
        "to join (default 600)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart all processes after a failure, up to K times",
    )
    launch.add_argument(
        "--min-nproc",
        type=int,
        metavar="M",
        help="elastic (one node): once the restarts are used up, a job that loses "
        "a process goes on with one fewer, never fewer than M, and fit resumes "
        "from its kd.Checkpoint on the new count (default: N, no shrinking)",
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
