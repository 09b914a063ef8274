"""`keras-dist plan --search`: `keras_dist.plan_search` from the command
line (the flags `keras-dist plan` adds for it, and the command itself)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

#: The `plan_search` arguments `--search` sets, and their flags.
SEARCH_FLAGS = {
    "time_budget": "--time-budget",
    "processes": "--processes",
    "cache_dir": "--cache-dir",
}
#: `keras-dist plan` flags that choose one distribution: the search chooses.
_CHOSEN_BY_THE_SEARCH = {
    "mesh": "--mesh",
    "axes": "--axes",
    "fsdp": "--fsdp",
    "layout_map": "--layout-map",
    "sequence_axis": "--sequence-axis",
    "png": "--png",
}


def add_search_flags(parser: argparse.ArgumentParser) -> None:
    """`--search`, `--time-budget`, `--processes` and `--cache-dir`."""
    parser.add_argument(
        "--search",
        action="store_true",
        help="with --topology (JAX): compile the candidate distributions (data "
        "parallel, FSDP, FSDP x tensor parallel, remat off and on) and print "
        "them ranked, those that fit first, then by projected step time; the "
        "train step is compiled",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="with --search: start no candidate once these are spent",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="with --search: candidates compiled at once, in worker processes",
    )
    parser.add_argument(
        "--cache-dir",
        metavar="PATH",
        help="with --search: keep each compiled candidate there, and reuse it",
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help='print what DistributeCallback("auto") would choose for this '
        "job's devices at --batch-size, without training (--device-memory on CPUs)",
    )


def run_auto(
    arguments: argparse.Namespace,
    model: Any,
    memory: int | None,
    input_shape: Any,
    said_as_flags: Callable[[str], str],
) -> int:
    """`keras-dist plan MODULE:FUNCTION --auto --batch-size B`: the line
    `DistributeCallback("auto")` prints, for this job's devices, without
    training; 1 when nothing fits or the choice is refused."""
    from keras_dist.training.auto import Auto, plan_auto  # noqa: PLC0415
    from keras_dist.training.out_of_memory import (  # noqa: PLC0415
        OutOfDeviceMemoryError,
    )

    if arguments.batch_size is None:
        arguments.usage_error("--auto needs --batch-size (the global batch).")
    try:
        choice = plan_auto(
            model,
            batch_size=arguments.batch_size,
            input_shape=input_shape,
            auto=Auto(device_memory=memory, cache_dir=arguments.cache_dir or True),
        )
    except (OutOfDeviceMemoryError, TypeError, ValueError, RuntimeError) as error:
        print(f"keras-dist plan --auto: {said_as_flags(str(error))}", file=sys.stderr)
        return 1
    print(choice.line)
    return 0


def run_search(
    arguments: argparse.Namespace,
    model: Any,
    memory: int | None,
    input_shape: Any,
    said_as_flags: Callable[[str], str],
) -> int:
    """`keras-dist plan MODULE:FUNCTION --search`: 0 when a candidate fits
    (or the memory is unknown), 1 when none does or the search is refused."""
    from keras_dist import cli_plan  # noqa: PLC0415
    from keras_dist.planner.compiled import UntrainableModelError  # noqa: PLC0415
    from keras_dist.planner.model import UnbuiltModelError  # noqa: PLC0415
    from keras_dist.planner.search import plan_search  # noqa: PLC0415
    from keras_dist.planner.search_result import render_table  # noqa: PLC0415

    chosen = [
        flag for name, flag in _CHOSEN_BY_THE_SEARCH.items() if getattr(arguments, name)
    ]
    if chosen:
        arguments.usage_error(
            f"--search chooses the mesh and the distribution itself: leave out "
            f"{', '.join(chosen)}."
        )
    try:
        results = plan_search(
            model,
            topology=arguments.topology,
            batch_size=arguments.batch_size,
            num_slices=arguments.num_slices,
            sequence_length=arguments.sequence_length,
            input_shape=input_shape,
            time_budget=arguments.time_budget,
            processes=arguments.processes,
            cache_dir=arguments.cache_dir,
            device_memory=memory,
        )
    except UnbuiltModelError as error:
        said = cli_plan.unbuilt_words(error, arguments.model)
        print(f"keras-dist plan --search: {said}", file=sys.stderr)
        return 1
    except UntrainableModelError as error:
        said = cli_plan.untrainable_words(error, arguments.model, search=True)
        print(f"keras-dist plan --search: {said}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as error:
        print(f"keras-dist plan --search: {said_as_flags(str(error))}", file=sys.stderr)
        return 1
    if arguments.json:
        print(json.dumps(results.to_dict()))
    else:
        # The notes and what to try next, said as this command's flags.
        print(render_table(results, said_as_flags))
    if results.best is None:
        nearest = results.nearest
        print(
            "keras-dist plan --search: no candidate fits"
            + (
                f"; the nearest, {nearest.description}, is "
                f"{nearest.shortfall_bytes:,} bytes short per device (what "
                "to try next is printed above)"
                if nearest is not None and not arguments.json
                else ""
            ),
            file=sys.stderr,
        )
        return 1
    return 0


__all__ = ["SEARCH_FLAGS", "add_search_flags", "run_auto", "run_search"]
