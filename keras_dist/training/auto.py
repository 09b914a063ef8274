"""`"auto"`: the distribution chosen for the model when its call starts.

when     a Keras `fit`/`evaluate`/`predict` given
         `DistributeCallback("auto")` (or a Trainer made with
         `distribution="auto"`) starts, before Keras builds anything or
         compiles a step; later calls of the same model reuse the choice
JAX      `plan_search(topology="local")` compiles the train step of a
         copy of the model made without values (`twin`), for this job's
         devices, at the call's global batch; the disk cache
         (`~/.cache/keras_dist/plans`) keeps each candidate's figures,
         keyed by the model, the devices, the batch and the versions
others   PyTorch and TensorFlow compile no plan: the static plan (from
         shapes) of what the backend has (PyTorch: DataParallel, FSDP,
         FSDP with remat; TensorFlow: DataParallel)
rule     `planner.auto_choice.pick`
agree    process 0 decides; the others read its choice as numbers
         (`gather_numbers`, bounded by `KERAS_DIST_INIT_TIMEOUT` plus the
         search's budget) and build the same distribution
say      one line on process 0 (`Choice.line`), unless `verbose=0`
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from typing import Any

import keras
import numpy as np

from keras_dist.backends import get_adapter
from keras_dist.common import job
from keras_dist.distribution.mesh import DeviceMesh
from keras_dist.planner import auto_choice
from keras_dist.planner.auto_choice import Choice
from keras_dist.planner.candidates import POLICIES, Candidate
from keras_dist.planner.compiled import abstract_model
from keras_dist.planner.plan import plan
from keras_dist.planner.search import plan_search
from keras_dist.training.out_of_memory import OutOfDeviceMemoryError

AUTO = "auto"
#: Seconds after which the search starts no more candidates (the one
#: compiling then runs to its end).
SEARCH_BUDGET = 60.0
#: What each backend can choose among from shapes (no compiled plan).
STATIC_CANDIDATES = {
    "torch": (("data_parallel", None), ("fsdp", None), ("fsdp", "full")),
    "tensorflow": (("data_parallel", None),),
}
_choices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Auto:
    """Let keras_dist choose the distribution: `DistributeCallback(Auto(...))`
    says what `DistributeCallback("auto")` leaves to defaults.

    When the call starts, keras_dist compiles fit's train step of each
    candidate (DataParallel, FSDP, FSDP x tensor parallel, a sequence axis,
    remat, offloaded or bfloat16 optimizer state) for the devices this job
    has (JAX), or reads the static plan (PyTorch, TensorFlow), and trains
    with the fastest projected one that fits each device with `headroom`
    to spare. Pipeline and expert parallelism are not searched. The choice
    is a projection from the compiled program, not a measured race.

    Args:
        device_memory: bytes a device may hold. Needed where the engine
            reports no limit (CPU devices); else the engine's limit.
        headroom: the share of `device_memory` kept free (0.1: a candidate
            fits when its planned peak is within 90 % of it).
        candidates: None (all), or the policy names to choose among, some of
            `("data_parallel", "fsdp", "fsdp_tp")`.
        cache_dir: keyword only. Where the search keeps each candidate's
            compiled figures: True (`~/.cache/keras_dist/plans`,
            `$XDG_CACHE_HOME`), a directory, or None (no cache).

    Example:

    ```python
    callback = keras_dist.DistributeCallback(keras_dist.Auto(device_memory=2**30))
    model.fit(x, y, batch_size=64, callbacks=[callback])
    callback.choice.description  # 'DataParallel, batch=8, remat off'
    ```
    """

    def __init__(
        self,
        device_memory: int | None = None,
        headroom: float = 0.1,
        candidates: list[str] | None = None,
        *,
        cache_dir: Any = True,
    ):
        if device_memory is not None and (
            isinstance(device_memory, bool)
            or not isinstance(device_memory, int)
            or device_memory < 1
        ):
            raise ValueError(
                "`device_memory` must be a positive int (bytes a device may "
                f"hold) or None. Received: device_memory={device_memory!r}"
            )
        if (
            isinstance(headroom, bool)
            or not isinstance(headroom, (int, float))
            or not 0 <= headroom < 1
        ):
            raise ValueError(
                "`headroom` must be a share of the memory kept free, 0 <= "
                f"headroom < 1 (0.1: 10 %). Received: headroom={headroom!r}"
            )
        if candidates is not None:
            if isinstance(candidates, str) or not isinstance(candidates, (list, tuple)):
                raise TypeError(
                    f"`candidates` must be a list of policy names from {POLICIES}"
                    f" or None. Received: candidates={candidates!r}"
                )
            unknown = [name for name in candidates if name not in POLICIES]
            if unknown or not candidates:
                raise ValueError(
                    f"`candidates` must name some of {POLICIES}. Received: "
                    f"candidates={candidates!r}"
                )
            candidates = list(candidates)
        if cache_dir is not None and not isinstance(
            cache_dir, (bool, str, os.PathLike)
        ):
            raise TypeError(
                "`cache_dir` must be True, a directory or None. Received: "
                f"cache_dir={cache_dir!r}"
            )
        self.device_memory = device_memory
        self.headroom = float(headroom)
        self.candidates = candidates
        self.cache_dir = cache_dir

    def settings(self) -> tuple:
        return (
            self.device_memory,
            self.headroom,
            tuple(self.candidates or ()),
            str(self.cache_dir),
        )

    def __repr__(self) -> str:
        return (
            f"Auto(device_memory={self.device_memory!r}, headroom={self.headroom!r}, "
            f"candidates={self.candidates!r})"
        )


def is_auto(value: Any) -> bool:
    """Whether `value` asks keras_dist to choose (`"auto"` or an `Auto`)."""
    return isinstance(value, Auto) or (isinstance(value, str) and value == AUTO)


def as_auto(value: Any) -> Auto:
    return value if isinstance(value, Auto) else Auto()


def choice_of(model: Any) -> Choice | None:
    """The choice made for `model` by its latest `"auto"` call, if any."""
    entry = _choices.get(model)
    return None if entry is None else entry[1]


# -- the call's batch --------------------------------------------------------------
def global_batch(arguments: dict) -> int:
    """The global batch of the call whose arguments are `arguments`: its
    `batch_size`, else for arrays Keras' default, 32, else the batch its data
    gives (a tf.data dataset's, a PyDataset's or a DataLoader's first batch);
    a `ValueError` for data that cannot say it unconsumed (a generator)."""
    size = arguments.get("batch_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    x = arguments.get("x")
    if x is None or _is_array_structure(x):
        return 32
    rows = _rows_of_first_batch(x)
    if rows is None:
        raise ValueError(
            '"auto" chooses for the global batch, and it cannot read it from x '
            f"of type {type(x).__name__} without consuming it (a generator, an "
            "iterator): give fit arrays with batch_size=, a tf.data dataset, a "
            "PyDataset or a DataLoader, or pass the distribution itself "
            "(`keras-dist plan MODEL --auto --batch-size B` says which)."
        )
    return rows


def _rows_of_first_batch(x: Any) -> int | None:
    loader_batch = getattr(x, "batch_size", None)
    if isinstance(loader_batch, int) and loader_batch > 0:
        return loader_batch
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        leaves = keras.tree.flatten(spec)
        shape = getattr(leaves[0], "shape", None) if leaves else None
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
        for batch in x.take(1):
            return _rows(batch)
    if isinstance(x, keras.utils.PyDataset):
        return _rows(x[0])
    return None


def _rows(batch: Any) -> int | None:
    leaves = [leaf for leaf in keras.tree.flatten(batch) if hasattr(leaf, "shape")]
    return int(leaves[0].shape[0]) if leaves else None


def _is_array_structure(x: Any) -> bool:
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(
        hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves
    )


def sample_shape(arguments: dict) -> Any:
    """One sample's shape (a structure like x's) when x is arrays, else None."""
    x = arguments.get("x")
    if x is None or not _is_array_structure(x):
        return None
    return keras.tree.map_structure(lambda leaf: tuple(leaf.shape)[1:], x)


# -- the copy that is searched -----------------------------------------------------
def twin(model: Any) -> Any:
    """A function making a copy of `model` (its class and config, compiled
    as it is); called inside the search, its variables get no values. The
    model being fit is never touched by the search."""

    def make() -> Any:
        copy = keras.models.clone_model(model)
        if getattr(model, "compiled", False):
            try:
                copy.compile_from_config(model.get_compile_config())
            except Exception:  # a loss or optimizer its config cannot rebuild
                optimizer = getattr(model, "optimizer", None)
                copy.compile(
                    optimizer=None
                    if optimizer is None
                    else type(optimizer).from_config(optimizer.get_config()),
                    loss=model.loss,
                )
        return copy

    return make


# -- deciding ------------------------------------------------------------------------
def _memory(auto: Auto) -> int:
    adapter = get_adapter()
    if auto.device_memory is not None:
        return auto.device_memory
    if adapter.name == "jax":
        reported = adapter.local_memory_bytes()
    else:
        limits = [adapter.device_memory_bytes(name) for name in adapter.list_devices()]
        reported = min(limits) if limits and all(limits) else None
    if reported is None:
        raise ValueError(
            "`auto` needs to know how much a device may hold, and these devices "
            "report no limit (CPU devices do not): pass it as "
            "keras_dist.Auto(device_memory=BYTES), e.g. "
            "DistributeCallback(keras_dist.Auto(device_memory=8 * 2**30))."
        )
    return reported


def _make(model: Any) -> Any:
    devices = get_adapter().list_devices()

    def make(candidate: Candidate) -> Any:
        mesh = DeviceMesh(
            tuple(candidate.mesh.values()), tuple(candidate.mesh), devices=devices
        )
        return candidate.distribution_function(model)(mesh)

    return make


def _nothing_fits(rows: list[Any], limit: int, memory: int, how: str) -> str:
    lines = [
        f"Nothing fits: no candidate keeps its peak within {auto_choice.in_gib(limit)}"
        f" a device ({auto_choice.in_gib(memory)} less the headroom), {how}. The "
        "candidates, nearest to fitting first:",
        *auto_choice.shortfalls(rows, limit),
    ]
    failed = [row for row in rows if getattr(row, "error", None)]
    lines += [f"  failed: {row.description}: {row.error[:300]}" for row in failed]
    return "\n".join(lines)


def _compiled_choice(
    model: Any, batch: int, input_shape: Any, auto: Auto, memory: int, limit: int
) -> Choice:
    began = time.monotonic()
    search = functools.partial(
        plan_search,
        twin(model),
        topology="local",
        batch_size=batch,
        input_shape=input_shape,
        device_memory=limit,
        cache_dir=auto.cache_dir,
    )
    results = None
    if auto.candidates is None or "data_parallel" in auto.candidates:
        # DataParallel first: where it fits and no step is projected (CPUs),
        # nothing else can win (a tie goes to the simplest).
        devices = len(get_adapter().list_devices())
        first = search(
            candidates=[Candidate("data_parallel", {"batch": devices})],
            time_budget=SEARCH_BUDGET,
        )
        if first[0].fits and first[0].step_seconds is None:
            results = first
    if results is None:
        # What is left of the one budget (the first candidate always starts).
        left = max(0.001, SEARCH_BUDGET - (time.monotonic() - began))
        results = search(candidates=auto.candidates, time_budget=left)
    rows = list(results)
    best = auto_choice.pick(rows)
    if best is None:
        how = f"compiled for this job's devices in {time.monotonic() - began:.1f} s"
        message = _nothing_fits(rows, limit, memory, how)
        tips = results.next_steps()[1:]
        raise OutOfDeviceMemoryError("\n".join([message, *tips]))
    devices = best.candidate.mesh
    data_parallel = next(
        (
            row
            for row in rows
            if row.candidate == Candidate("data_parallel", {"batch": _count(devices)})
        ),
        None,
    )
    dp_peak = None
    if data_parallel is not None:
        dp_peak = data_parallel.peak_bytes
        if dp_peak is None and data_parallel.shortfall_bytes is not None:
            dp_peak = limit + data_parallel.shortfall_bytes
    searched = sum(row.status in ("compiled", "cached", "screened") for row in rows)
    return Choice(
        None,
        best.candidate,
        best.peak_bytes,
        limit,
        memory,
        best.step_seconds,
        time.monotonic() - began,
        "compiled",
        searched,
        dp_peak,
        None if data_parallel is None else data_parallel.step_seconds,
    )


def _count(mesh: dict) -> int:
    return int(np.prod(list(mesh.values())))


class _StaticRow:
    """A candidate's static plan, as `pick` and `shortfalls` read a row."""

    def __init__(self, candidate: Candidate, peak: int, limit: int):
        self.candidate = candidate
        self.peak_bytes = peak
        self.fits = peak <= limit
        self.step_seconds = None
        self.shortfall_bytes = None if self.fits else peak - limit
        self.description = candidate.description
        self.error = None


def _static_choice(
    model: Any, batch: int, input_shape: Any, auto: Auto, memory: int, limit: int
) -> Choice:
    began = time.monotonic()
    adapter = get_adapter()
    devices = len(adapter.list_devices())
    rows = []
    for policy, remat in STATIC_CANDIDATES.get(adapter.name, ()):
        if auto.candidates is not None and policy not in auto.candidates:
            continue
        candidate = Candidate(policy, {"batch": devices}, remat=remat)
        static = plan(
            model,
            candidate.distribution_function(model),
            mesh=candidate.mesh,
            input_shape=input_shape,
            batch_size=batch,
            device_memory=memory,
            on_indivisible="replicate",
        )
        # Remat recomputes the activations in the backward pass: their
        # estimate is left out (a lower bound).
        peak = max(
            device.total - ((device.activations or 0) if remat else 0)
            for device in static.devices
        )
        rows.append(_StaticRow(candidate, peak, limit))
    if not rows:
        raise ValueError(
            f"`candidates={auto.candidates!r}` leaves nothing the {adapter.name} "
            "backend can choose from shapes: it has "
            f"{sorted({p for p, _ in STATIC_CANDIDATES.get(adapter.name, ())})}."
        )
    best = auto_choice.pick(rows)
    if best is None:
        raise OutOfDeviceMemoryError(
            _nothing_fits(rows, limit, memory, "from shapes (the static plan)")
        )
    data_parallel = next(
        (row for row in rows if row.candidate.policy == "data_parallel"), None
    )
    return Choice(
        None,
        best.candidate,
        best.peak_bytes,
        limit,
        memory,
        None,
        time.monotonic() - began,
        "shapes",
        len(rows),
        None if data_parallel is None else data_parallel.peak_bytes,
    )


def _decide(model: Any, batch: int, input_shape: Any, auto: Auto) -> Choice:
    memory = _memory(auto)
    limit = int(memory * (1 - auto.headroom))
    if get_adapter().name == "jax":
        return _compiled_choice(model, batch, input_shape, auto, memory, limit)
    return _static_choice(model, batch, input_shape, auto, memory, limit)


def choose(
    model: Any, name: str, arguments: dict, auto: Auto, *, any_earlier: bool = False
) -> Choice:
    """The choice for `model`'s call `name` (`arguments`: the call's), made
    on process 0 and read by the others, or reused from the model's earlier
    call (one made with the same settings, or any with `any_earlier`: the
    plain word "auto"); says it in one line on process 0 unless
    `verbose=0`."""
    entry = _choices.get(model)
    if entry is not None and (any_earlier or entry[0] == auto.settings()):
        return entry[1]
    adapter = get_adapter()
    rank = adapter.process_id()
    numbers = [auto_choice.FAILED] + [0.0] * (auto_choice.WIDTH - 1)
    failure: BaseException | None = None
    if rank == 0:
        try:
            input_shape = None if model.built else sample_shape(arguments)
            batch = global_batch(arguments)
            numbers = auto_choice.encode(_decide(model, batch, input_shape, auto))
        except OutOfDeviceMemoryError as error:
            numbers[0], failure = auto_choice.NOTHING_FITS, error
        except Exception as error:  # told to the others, then raised here
            failure = error
    if adapter.num_processes() > 1:
        gathered = adapter.gather_numbers(
            numbers,
            timeout_seconds=job.timeout_seconds() + 2 * SEARCH_BUDGET,
        )
        numbers = gathered[0]
    if failure is not None:
        raise failure
    if auto_choice.status(numbers) == auto_choice.NOTHING_FITS:
        raise OutOfDeviceMemoryError(
            f"Process 0 chose for {model.name!r} and nothing fits the devices: "
            "its error lists the candidates and their shortfalls."
        )
    if auto_choice.status(numbers) == auto_choice.FAILED:
        raise RuntimeError(
            f"Process 0 failed while choosing a distribution for {model.name!r}: "
            "its error says why."
        )
    choice = auto_choice.decode(numbers, _make(model), model)
    _choices[model] = (auto.settings(), choice)
    if rank == 0 and arguments.get("verbose", "auto") != 0:
        print(choice.line, flush=True)
    return choice


def plan_auto(
    model: Any, *, batch_size: int, input_shape: Any = None, auto: Auto | None = None
) -> Choice:
    """What `"auto"` would choose for `model` (a model, or a function of no
    arguments making one, made without values) at the global `batch_size`,
    without training: `keras-dist plan MODEL --auto`. One process; raises
    `OutOfDeviceMemoryError` where nothing fits."""
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise ValueError(
            f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}"
        )
    if not isinstance(model, keras.layers.Layer):
        model = abstract_model(model, input_shape)
    auto = auto or Auto()
    numbers = auto_choice.encode(_decide(model, batch_size, input_shape, auto))
    return auto_choice.decode(numbers, _make(model), model)


__all__ = [
    "AUTO",
    "Auto",
    "SEARCH_BUDGET",
    "as_auto",
    "choice_of",
    "choose",
    "is_auto",
    "plan_auto",
]
