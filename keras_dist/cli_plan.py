"""What `keras-dist plan` runs on and says of the model in its own words:
the backend it picks for `--topology` and `--search` (JAX, which compiles
for a topology), and the planner's refusals of a model (not built, not
compiled) said as the command's flags, where the library speaks Python."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any


def choose_backend(arguments: argparse.Namespace) -> str | None:
    """With `--topology` or `--search`, run on JAX, before Keras is imported:
    set `KERAS_BACKEND=jax` unless the user set it (Keras' own default,
    `keras.json`'s or TensorFlow, cannot compile for a topology). Returns
    why it cannot (another backend set explicitly, JAX not installed), or
    None."""
    if not (arguments.topology or arguments.search):
        return None
    wanted = "--search" if arguments.search else "--topology"
    chosen = os.environ.get("KERAS_BACKEND")
    if chosen:
        if chosen == "jax":
            return None
        return (
            f"{wanted} compiles fit's steps with XLA, on the JAX backend; "
            f"KERAS_BACKEND={chosen} is set: run it with KERAS_BACKEND=jax (or "
            "with KERAS_BACKEND unset: the command then picks JAX). Without "
            "--topology and --search the plan is the static one, on any "
            f"backend. Received: KERAS_BACKEND={chosen}"
        )
    keras = sys.modules.get("keras")
    if keras is not None:
        # Started already: `KERAS_DIST_CPU_DEVICES` starts the backend when
        # keras_dist is imported, before the command reads its flags.
        started = keras.backend.backend()
        if started == "jax":
            return None
        return (
            f"{wanted} compiles fit's steps with XLA, on the JAX backend; Keras "
            f"started on its default backend, {started}, before the command "
            "could pick JAX (KERAS_DIST_CPU_DEVICES starts it when keras_dist "
            "is imported): run it with KERAS_BACKEND=jax."
        )
    if importlib.util.find_spec("jax") is None:
        return (
            f"{wanted} compiles fit's steps with XLA and needs JAX, which is not "
            "installed: pip install jax (for TPU topologies: pip install "
            '"keras-dist[tpu]"). Without --topology and --search the plan is '
            "the static one, on any backend."
        )
    os.environ["KERAS_BACKEND"] = "jax"
    return None


def unbuilt_words(error: Any, spec: str) -> str:
    """An `UnbuiltModelError` said for `keras-dist plan` (`spec`: the
    MODULE:FUNCTION given)."""
    return (
        f"the model {error.model_name!r} ({error.model_type}) that {spec} returns "
        "is not built, so its variables have no shapes yet and a plan of it "
        "would be empty: pass --input-shape with the shape of one sample "
        "without the batch dimension (e.g. --input-shape 1024, or NAME=SHAPE "
        "once per input), or give the model a keras.Input. Received: no "
        "--input-shape"
    )


def untrainable_words(error: Any, spec: str, search: bool) -> str:
    """An `UntrainableModelError` said for `keras-dist plan`: the model file's
    function must compile the model (the command has no flags for its loss;
    `--optimizer` only counts slots in the static plan)."""
    several = len(error.steps) > 1 and not search
    needing = (
        "the train step --search compiles needs"
        if search
        else f"the {' and '.join(error.steps)} step{'s' if several else ''} "
        f"compiled for --topology need{'' if several else 's'}"
    )
    if error.missing == "compile":
        said = (
            f"the model {error.model_name!r} that {spec} returns is not "
            f"compiled, and {needing} its loss and optimizer: the model file's "
            "function must compile it (call model.compile(optimizer=..., "
            "loss=...) before returning it)"
        )
    else:
        said = (
            f"the model {error.model_name!r} that {spec} returns was compiled "
            f"without a loss, and {needing} one: the model file's function "
            "must give its model.compile a loss"
        )
    if not search:
        said += ", or compile only prediction with --steps predict"
    return said + f". Received: {spec}"


__all__ = ["choose_backend", "unbuilt_words", "untrainable_words"]


def plan_distribution(arguments: argparse.Namespace, layout: Any) -> Any:
    """The function of the mesh that makes the distribution the flags say."""
    import keras_dist  # noqa: PLC0415  (after argument parsing: imports the backend)

    options = {"sequence_axis": arguments.sequence_axis}

    def make(mesh: Any) -> Any:
        layout_map = None if layout is None else layout(mesh)
        if arguments.fsdp:
            return keras_dist.FSDP(
                mesh,
                axis=mesh.axis_names[0],
                min_size=arguments.min_size,
                layout_map=layout_map,
                **options,
            )
        if layout_map is not None:
            return keras_dist.ModelParallel(mesh, layout_map, **options)
        return keras_dist.DataParallel(mesh, **options)

    return make
