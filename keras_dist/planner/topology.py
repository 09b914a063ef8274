"""Topology names `keras_dist.plan(..., topology=...)` takes, read without
asking any engine, so that a wrong one is refused before anything compiles.

    "cpu:8"        8 CPU devices of this process
    "local"        the devices this job has: every process' GPUs, TPU chips
                   or CPUs (their count and kind asked of the engine when
                   the plan is compiled)
    "v5e:2x2"      a TPU slice by generation and chip grid (as libtpu names it)
    "v5e-256"      a TPU slice as Cloud names it (v5e, v6e: chips; v4, v5p:
                   TensorCores, two a chip), laid out as Cloud's default grid
    "v5litepod-16" Cloud's name for v5e slices, "v6e-8" ...
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Generations, their chip grid's rank, and whether Cloud's "-N" counts cores.
GENERATIONS = {
    "v4": (3, True),
    "v5e": (2, False),
    "v5p": (3, True),
    "v6e": (2, False),
}
#: The topology of the devices this job has (`plan(..., topology="local")`).
LOCAL = "local"
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e"}
# Cloud's default grids by chip count (TPU v5e, v6e: 2-D; v4, v5p: 3-D).
GRIDS_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
GRIDS_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
_EXAMPLES = '"v5e:2x2", "v5e-256", "v5p:4x4x8", "v6e-8", "cpu:8" or "local"'


def known_slices(generation: str) -> str:
    """The slices of `generation` Cloud offers, in words: their chip grids,
    one host's and several hosts'."""
    rank, counts_cores = GENERATIONS[generation]
    grids = GRIDS_3D if rank == 3 else GRIDS_2D
    host_chips = 4 if rank == 3 else 8  # v4, v5p: 2x2x1 a host; v5e, v6e: 2x4
    one_host = [grid for chips, grid in grids.items() if chips <= host_chips]
    several = [grid for grid in grids.values() if grid not in one_host]
    unit = "TensorCores, two a chip" if counts_cores else "chips"
    return (
        f"The {generation} slices: {', '.join(one_host)} (one host), "
        f"{', '.join(several)} (several hosts); by Cloud's names "
        f"{generation}-N, N the {unit}: "
        f"{', '.join(str(c * 2 if counts_cores else c) for c in grids)}."
    )


@dataclass(frozen=True)
class Topology:
    """A topology by name.

    Attributes:
        name: as given.
        platform: "tpu", "cpu" or "local" (this job's own devices).
        libtpu_name: the name libtpu takes ("v5e:16x16"), "" otherwise.
        chips: chips (CPU devices) in one slice; 0 for "local", whose
            devices are counted when the plan is compiled.
        num_slices: slices joined by the data-center network.
    """

    name: str
    platform: str
    libtpu_name: str
    chips: int
    num_slices: int = 1


def parse_topology(name: object, num_slices: object = 1) -> Topology:
    """The `Topology` `name` means, or a `ValueError` naming what is known.

    Example:

    >>> parse_topology("v5e-256").libtpu_name
    'v5e:16x16'
    >>> parse_topology("v5p-128").chips
    64
    >>> parse_topology("cpu:8").chips
    8
    >>> parse_topology("local").platform
    'local'
    """
    if isinstance(num_slices, bool) or not isinstance(num_slices, int):
        raise TypeError(
            f"`num_slices` must be an int. Received: num_slices={num_slices!r}"
        )
    if num_slices < 1:
        raise ValueError(
            f"`num_slices` must be at least 1. Received: num_slices={num_slices}"
        )
    if not isinstance(name, str):
        raise TypeError(
            f"`topology` must be a string such as {_EXAMPLES}. Received: "
            f"topology={name!r}"
        )
    spelled = name.strip().lower()
    if spelled == LOCAL:
        if num_slices != 1:
            raise ValueError(
                "topology='local' is the devices this job has, however many "
                "slices they span: give no num_slices. Received: "
                f"num_slices={num_slices}"
            )
        return Topology(name, LOCAL, "", 0)
    cpu = re.fullmatch(r"cpu:(\d+)", spelled)
    if cpu:
        if num_slices != 1:
            raise ValueError(
                "CPU topologies have one slice. Received: topology="
                f"{name!r}, num_slices={num_slices}"
            )
        count = int(cpu.group(1))
        if count < 1:
            raise ValueError(f"`topology` 'cpu:N' needs N >= 1. Received: {name!r}")
        return Topology(name, "cpu", "", count)
    grid = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", spelled)
    counted = re.fullmatch(r"([a-z0-9]+)-(\d+)", spelled)
    match = grid or counted
    generation = ALIASES.get(match.group(1), match.group(1)) if match else None
    if generation not in GENERATIONS:
        raise ValueError(
            f"Unknown topology {name!r}: give a TPU slice as generation:grid or "
            f"as Cloud's generation-count, generation one of "
            f"{sorted(GENERATIONS)} (or {sorted(ALIASES)}), or cpu:N; e.g. "
            f"{_EXAMPLES}."
        )
    rank, counts_cores = GENERATIONS[generation]
    grids = GRIDS_3D if rank == 3 else GRIDS_2D
    if grid:
        dims = [int(size) for size in grid.group(2).split("x")]
        if len(dims) != rank or min(dims) < 1:
            raise ValueError(
                f"A {generation} slice is a {rank}-D grid of chips, e.g. "
                f"{generation}:{next(iter(grids.values()))}. Received: "
                f"topology={name!r}"
            )
        if any(size > 1 and size % 2 for size in dims[:2]):
            # libtpu lays a slice out on hosts of 2x2 chips: a grid of more
            # than one chip along an axis must fill whole hosts.
            raise ValueError(
                f"There is no {generation} slice of {grid.group(2)} chips: each "
                "of the grid's first two sizes is 1 or even (libtpu places "
                f"2x2 chips on a host). {known_slices(generation)} Received: "
                f"topology={name!r}"
            )
        return Topology(
            name, "tpu", f"{generation}:{grid.group(2)}", math.prod(dims), num_slices
        )
    count = int(counted.group(2))
    chips = count // 2 if counts_cores else count
    if (counts_cores and count % 2) or chips not in grids:
        unit = "TensorCores (two a chip)" if counts_cores else "chips"
        sizes = [size * 2 if counts_cores else size for size in grids]
        raise ValueError(
            f"{generation}-N counts {unit}; the slices keras_dist knows the grid "
            f"of are N in {sizes}. Received: topology={name!r}; for another "
            f"grid give it as {generation}:AxB{'xC' if rank == 3 else ''}."
        )
    return Topology(name, "tpu", f"{generation}:{grids[chips]}", chips, num_slices)
