"""`keras_dist.plan_search`: compile the candidate distributions of a model
for a topology and rank them.

    candidates   (`planner/candidates.py`) data parallel, FSDP, FSDP x tensor
                 parallel over the model axes the model allows, FSDP with a
                 sequence axis for long sequences; remat off, on
    cache        (`planner/search_cache.py`) hits are read first, cost nothing
    screen       a candidate whose variables and optimizer state alone exceed
                 a device's memory (static plan) does not fit: not compiled
    remat twin   remat on is compiled only when remat off does not fit: it
                 recomputes, so it can only be slower
    savers       a default candidate that does not fit (or fits closely) gets
                 its memory-saving variants added (`Candidate.savers`)
    budget       no candidate starts once `time_budget` seconds are spent (the
                 first always does); those left are listed as not tried
    processes    candidates compile in worker processes ("spawn", JAX) when
                 the model is a picklable function, else in this process

Each candidate is compiled by `keras_dist.plan(..., topology=...)`, the same
steps `fit` runs; `largest_batch=True` then searches the best one's largest
batch (`planner/batch_search.py`). A step XLA refuses (out of memory) ranks
as not fitting, with XLA's words; any other exception is kept on its
candidate.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from keras_dist.backends import get_adapter
from keras_dist.planner.batch_search import best_largest_batch
from keras_dist.planner.candidates import (
    CLOSE,
    Candidate,
    chosen_candidates,
    sequence_length_of,
)
from keras_dist.planner.compiled import (
    STEP_KINDS,
    TopologyMesh,
    abstract_model,
    check_topology_arguments,
    check_trainable,
)
from keras_dist.planner.plan import plan
from keras_dist.planner.result import CompiledPlan, Plan, Problem
from keras_dist.planner.search_cache import (
    SearchCache,
    cache_key,
    compiled_from_dict,
    default_cache_dir,
    entry_problems,
    model_fingerprint,
)
from keras_dist.planner.search_result import SearchResult, SearchResults
from keras_dist.planner.topology import parse_topology


@dataclass
class Outcome:
    """What compiling one candidate gave (picklable: it comes back from
    worker processes, without the `plan`)."""

    compiled: CompiledPlan | None = None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    screened: str | None = None
    seconds: float = 0.0
    plan: Plan | None = None
    # A screened candidate's bytes short per device (static plan).
    shortfall: int | None = None


@dataclass(frozen=True)
class Job:
    """What every candidate of one search shares (picklable)."""

    topology: str
    num_slices: int
    batch_size: int
    sequence_length: int | None
    input_shape: Any
    target_shape: Any
    steps: tuple[str, ...]
    device_memory: int | None
    memory: int | None  # the devices' memory for the screen: given, or the chip's
    # The devices in words (`TopologyMesh.describe`): "local" is keyed by
    # what it is on this job, not by its name.
    devices: str | None = None

    def fingerprint(self) -> dict[str, Any]:
        return {
            "topology": self.devices or _topology_key(self.topology, self.num_slices),
            "num_slices": self.num_slices,
            "batch_size": self.batch_size,
            "sequence_length": self.sequence_length,
            "input_shape": repr(self.input_shape),
            "target_shape": repr(self.target_shape),
            "steps": list(self.steps),
        }


def _topology_key(name: str, num_slices: int) -> str:
    """One spelling per topology: "v5e-256" and "v5e:16x16" are one."""
    parsed = parse_topology(name, num_slices)
    return parsed.libtpu_name or f"{parsed.platform}:{parsed.chips}"


def _screen(
    model: Any, function: Any, candidate: Candidate, job: Job
) -> tuple[str, int] | None:
    """Why `candidate` cannot fit, from its static plan (its variables and
    optimizer state per device against the memory), and by how many bytes
    per device; or None."""
    if job.memory is None:
        return None
    static = plan(
        model,
        function,
        mesh=candidate.mesh,
        input_shape=job.input_shape,
        sequence_length=job.sequence_length,
        batch_size=job.batch_size,
        device_memory=job.memory,
        on_indivisible="replicate",
    )
    # Offloaded optimizer state is held by the host; bfloat16 state is half
    # of float32's (the static plan counts the variables' dtype).
    share = 0 if candidate.offload else 0.5 if candidate.optimizer_state_dtype else 1
    held = max(
        device.parameters + int(share * device.optimizer_slots)
        for device in static.devices
    )
    if held <= job.memory:
        return None
    return (
        f"not compiled: the variables and optimizer state alone need {held:,} "
        f"bytes per device (static plan), more than the {job.memory:,} there",
        held - job.memory,
    )


def compile_candidate(model: Any, candidate: Candidate, job: Job) -> Outcome:
    """Screen and compile one candidate of `model` (made by
    `abstract_model`); every exception is kept on the outcome."""
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            function = candidate.distribution_function(model)
            screened = _screen(model, function, candidate, job)
            result = None
            if screened is None:
                result = plan(
                    model,
                    function,
                    topology=job.topology,
                    num_slices=job.num_slices,
                    mesh=candidate.mesh,
                    input_shape=job.input_shape,
                    sequence_length=job.sequence_length,
                    batch_size=job.batch_size,
                    device_memory=job.device_memory,
                    target_shape=job.target_shape,
                    steps=job.steps,
                )
        except Exception as error:  # a candidate's failure is its result
            return Outcome(
                error=f"{type(error).__name__}: {error}",
                warnings=_said(caught),
                seconds=time.perf_counter() - started,
            )
    return Outcome(
        compiled=None if result is None else result.compiled,
        problems=[] if result is None else list(result.problems),
        warnings=_said(caught),
        screened=None if screened is None else screened[0],
        seconds=time.perf_counter() - started,
        plan=result,
        shortfall=None if screened is None else screened[1],
    )


def _refused(compiled: CompiledPlan | None) -> str | None:
    """The error of a step that failed for another reason than memory."""
    if compiled is None or compiled.fits is False:
        return None
    for step in compiled.steps.values():
        if step.error:
            return f"the {step.kind} step failed: {step.error}"
    return None


def _said(caught: list[Any]) -> list[str]:
    """What a candidate warned, each once; deprecations (of the libraries
    under it, not of the candidate) left out."""
    said: list[str] = []
    for item in caught:
        if issubclass(item.category, (DeprecationWarning, PendingDeprecationWarning)):
            continue
        text = f"{item.category.__name__}: {item.message}"
        if text not in said:
            said.append(text)
    return said


# -- worker processes ----------------------------------------------------------
_WORKER_MODELS: dict[Any, Any] = {}


def compile_in_worker(function: Any, candidate: Candidate, job: Job) -> Outcome:
    """`compile_candidate` in a worker process: the model is made once per
    process from its picklable function."""
    key = (function, repr(job.input_shape))
    if key not in _WORKER_MODELS:
        _WORKER_MODELS[key] = abstract_model(function, job.input_shape)
    outcome = compile_candidate(_WORKER_MODELS[key], candidate, job)
    outcome.plan = None  # holds devices of this process
    return outcome


@contextlib.contextmanager
def _worker_environment(job_devices: int | None) -> Iterator[None]:
    """The environment spawned workers start from: the JAX backend, and as
    many simulated CPU devices as a `cpu:N` topology needs."""
    wanted = {"KERAS_BACKEND": "jax"}
    if job_devices is not None:
        wanted["KERAS_DIST_CPU_DEVICES"] = str(job_devices)
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _InThisProcess:
    """An executor that runs each call at once, here."""

    def submit(self, function: Any, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(function(*args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        del wait, cancel_futures  # nothing runs in the background


# -- the search ----------------------------------------------------------------
def _check_number(name: str, value: Any, *, integer: bool, optional: bool) -> None:
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive int" if integer else "a positive number of seconds"
        raise ValueError(
            f"`{name}` must be {what}{' or None' if optional else ''}. "
            f"Received: {name}={value!r}"
        )


def _cache(cache_dir: Any) -> SearchCache | None:
    if cache_dir is None or cache_dir is False:
        return None
    if cache_dir is True:
        return SearchCache(default_cache_dir())
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(
            "`cache_dir` must be a directory (str or path), True for "
            f"{default_cache_dir()}, or None. Received: cache_dir={cache_dir!r}"
        )
    return SearchCache(cache_dir)


def _picklable(model: Any) -> str | None:
    """Why `model` cannot go to worker processes, or None."""
    if not callable(model) or hasattr(model, "built"):
        return "a model object is compiled in this process"
    try:
        pickle.dumps(model)
    except Exception as error:  # pickling raises many types
        return (
            f"the model function cannot be pickled ({type(error).__name__}: "
            f"{error}); give a module-level function to compile in "
            "worker processes"
        )
    return None


class _Search:
    def __init__(
        self, model: Any, made: Any, job: Job, mesh: TopologyMesh, savers: bool
    ):
        self.model = model
        self.savers = savers
        self.made = made
        self.job = job
        self.topology_mesh = mesh
        self.results: dict[Candidate, SearchResult] = {}
        self.notes: list[str] = []

    def result(self, candidate: Candidate, outcome: Outcome) -> SearchResult:
        refused = _refused(outcome.compiled)
        if refused is not None and outcome.error is None:
            # A step that failed for another reason than memory (the model's
            # own code while it was traced, say) is the candidate's failure.
            outcome.error = refused
        if outcome.error is not None:
            status = "failed"
        elif outcome.screened is not None:
            status = "screened"
        else:
            status = "compiled"
        result = SearchResult(
            candidate,
            status,
            compiled=outcome.compiled,
            plan=outcome.plan,
            error=outcome.error,
            reason=outcome.screened,
            screened_shortfall=outcome.shortfall,
            problems=outcome.problems,
            warnings=outcome.warnings,
            seconds=outcome.seconds,
            maker=self.maker(candidate),
        )
        self.results[candidate] = result
        return result

    def maker(self, candidate: Candidate) -> Any:
        def make() -> Any:
            function = candidate.distribution_function(self.made)
            return self.topology_mesh.distribution(function, candidate.mesh)

        return make

    def skip(self, candidate: Candidate, reason: str) -> None:
        self.results[candidate] = SearchResult(candidate, "skipped", reason=reason)

    def twin_fits(self, candidate: Candidate) -> bool | None:
        """Whether the remat-off twin of a remat-on candidate fits (None:
        no twin, not known yet, or unknown)."""
        if candidate.remat is None or candidate.plain:
            return None
        twin = self.results.get(candidate.twin)
        return None if twin is None else twin.fits

    def run(
        self,
        order: list[Candidate],
        executor: Any,
        workers: int,
        deadline: float | None,
        budget: Any,
    ) -> None:
        pending = list(order)
        running: dict[concurrent.futures.Future, Candidate] = {}
        started = 0
        while pending or running:
            while pending and len(running) < workers:
                ready = [
                    c
                    for c in pending
                    if c.plain or c.twin not in pending + list(running.values())
                ]
                if not ready:
                    break
                candidate = ready[0]
                pending.remove(candidate)
                if self.twin_fits(candidate):
                    self.skip(
                        candidate,
                        "not compiled: remat off fits, and recomputing only adds time",
                    )
                    continue
                if deadline is not None and started and time.monotonic() >= deadline:
                    for left in [candidate, *pending]:
                        self.skip(
                            left, f"not tried: the time budget of {budget} s was spent"
                        )
                    pending = []
                    break
                started += 1
                running[self.submit(executor, candidate)] = candidate
            if not running:
                continue
            done, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                candidate = running.pop(future)
                try:
                    outcome = future.result()
                except Exception as error:  # a worker process died
                    outcome = Outcome(error=f"{type(error).__name__}: {error}")
                result = self.result(candidate, outcome)
                pending += self.savers_of(candidate, result)

    def savers_of(self, candidate: Candidate, result: SearchResult) -> list:
        """The memory savers of a plain candidate that does not fit or fits
        closely (`candidates.CLOSE`), when the search adds them."""
        if not self.savers or not candidate.plain or result.fits is None:
            return []
        memory = self.job.memory
        margin = result.margin_bytes
        close = margin is not None and memory and margin < CLOSE * memory
        if result.fits and not close:
            return []
        savers = [c for c in candidate.savers() if c not in self.results]
        # A candidate that fits closely gets headroom, not recomputation.
        return [c for c in savers if not result.fits or c.remat is None]

    def submit(self, executor: Any, candidate: Candidate) -> Any:
        function = (
            compile_candidate
            if isinstance(executor, _InThisProcess)
            else compile_in_worker
        )
        model = self.made if function is compile_candidate else self.model
        try:
            return executor.submit(function, model, candidate, self.job)
        except Exception as error:  # a broken pool refuses every submission
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(error)
            return future


def plan_search(
    model: Any,
    *,
    topology: str,
    batch_size: int,
    num_slices: int = 1,
    sequence_length: int | None = None,
    input_shape: Any = None,
    time_budget: float | None = None,
    processes: int = 1,
    cache_dir: Any = None,
    candidates: Any = None,
    device_memory: int | None = None,
    target_shape: Any = None,
    steps: tuple[str, ...] = ("train",),
    largest_batch: bool = False,
) -> SearchResults:
    """Compile the candidate distributions of `model` for `topology` and
    rank them: those that fit first, then by projected step time (by peak
    bytes per device where no time is projected, as on CPUs).

    The candidates: `DataParallel` and `FSDP` on every device, and FSDP x
    tensor parallel on meshes `{"batch": d, "model": m}` for each power of
    two `m` dividing the device count, the model's attention heads and its
    width (KerasHub models: their backbone's own layout map; others:
    `keras_dist.layouts.tensor_parallel`), each with remat off and on
    (each transformer block recomputed for KerasHub models, `"full"`
    otherwise). Remat on is compiled only where remat off does not fit.
    Where the sequence is long (1024 or more, or attention scores a large
    part of a device's memory), the model has attention keras_dist can
    split, and the global batch leaves devices without a whole sequence
    each, also FSDP with a sequence axis (`sequence_axis="seq"`) on meshes
    `{"batch": d, "seq": s}` (`planner/candidates.py` says the rule).

    Args:
        model: a function of no arguments returning a compiled Keras model
            (made without allocating it), or a model. To compile in worker
            processes, a module-level function (it is pickled).
        topology: as `keras_dist.plan`'s: `"v5e-256"`, `"v5p:4x4x8"`,
            `"cpu:8"`..., or `"local"`: the devices this job has (every
            process' GPUs, TPU chips or CPUs), compiled in this process.
        batch_size: the global batch.
        num_slices: TPU slices (data-center network between them).
        sequence_length: the sequence length of a KerasHub model's inputs.
        input_shape: one sample's shape, for models whose inputs say none.
        time_budget: seconds; no candidate starts once they are spent (the
            first always does, and one started runs to its end). None: no
            limit.
        processes: candidates compiled at once. 1: one after the other, in
            this process. More: in worker processes ("spawn" context, JAX
            backend), each making the model from its function: worth it for
            large models, given the cores and the memory (on one CPU core a
            2B-parameter model's compile for 256 chips took 3 to 5 minutes
            and 6 GB; a 7B's for 64 chips up to 16 GB). A model object, or a
            function that cannot be pickled, compiles in this process.
        cache_dir: a directory where each compiled candidate is kept as JSON,
            keyed by a fingerprint of the model, its compile configuration,
            the candidate, the job and the versions; a hit is not compiled
            again. True: `~/.cache/keras_dist/plans` (`$XDG_CACHE_HOME`).
            None: no cache.
        candidates: None (all), policy names to keep (`["fsdp", "fsdp_tp"]`),
            or `keras_dist.planner.Candidate`s.
        device_memory: bytes per device, instead of the chip's.
        target_shape: as `keras_dist.plan`'s.
        steps: the steps compiled; the train step alone by default.
        largest_batch: then compile the best candidate at larger global
            batches (doubling, then bisecting, in multiples of its batch
            axis; at most `batch_search.MAX_COMPILES` compiles, within
            `time_budget`) for the largest that fits: `.largest_batch`.

    Returns:
        `SearchResults`: iterate it for `SearchResult`s (each with its
        `distribution`, `description`, `compiled` figures), `.best`, and
        print it for the ranked table.

    Example:

    >>> results = keras_dist.plan_search(build, topology="cpu:8", batch_size=64)
    >>> print(results)
    >>> model.fit(x, y, callbacks=[
    ...     keras_dist.DistributeCallback(results.best.distribution)])
    """
    began = time.monotonic()
    parsed = check_topology_arguments(topology, num_slices, None)
    _check_number("batch_size", batch_size, integer=True, optional=False)
    _check_number("time_budget", time_budget, integer=False, optional=True)
    _check_number("processes", processes, integer=True, optional=False)
    _check_number("device_memory", device_memory, integer=True, optional=True)
    kinds = tuple(steps) if isinstance(steps, (tuple, list)) else (steps,)
    if not kinds or any(kind not in STEP_KINDS for kind in kinds):
        raise ValueError(
            f"`steps` must name some of {STEP_KINDS}. Received: steps={steps!r}"
        )
    cache = _cache(cache_dir)
    adapter = get_adapter()
    if adapter.name != "jax":
        raise NotImplementedError(
            f"plan_search compiles with XLA and needs the JAX backend "
            f"(KERAS_BACKEND=jax); on {adapter.name}, keras_dist.plan without "
            "topology= gives the static plan of one distribution."
        )
    made = abstract_model(model, input_shape)
    check_trainable(made, kinds)
    topology_mesh = TopologyMesh(parsed)
    devices = len(topology_mesh.devices)
    chip_memory = topology_mesh.memory()
    order = chosen_candidates(
        candidates,
        made,
        devices,
        parsed.num_slices,
        batch_size=batch_size,
        sequence_length=sequence_length_of(made, input_shape, sequence_length),
        memory=device_memory or chip_memory,
    )
    job = Job(
        topology,
        parsed.num_slices,
        batch_size,
        sequence_length,
        input_shape,
        target_shape,
        kinds,
        device_memory,
        device_memory or chip_memory,
        topology_mesh.describe(),
    )
    # Memory savers are added to the default candidates, not to a list given.
    savers = candidates is None or all(isinstance(c, str) for c in candidates)
    search = _Search(model, made, job, topology_mesh, savers)
    keys = {}
    model_part = None if cache is None else model_fingerprint(made)

    def cached(candidate: Candidate) -> bool:
        """Whether `candidate`'s result was read from the cache."""
        if cache is None:
            return False
        keys[candidate] = cache_key(model_part, job.fingerprint(), candidate)
        entry = cache.load(keys[candidate])
        if entry is None:
            return False
        search.results[candidate] = SearchResult(
            candidate,
            "cached",
            compiled=compiled_from_dict(
                entry["compiled"], device_memory or chip_memory
            ),
            problems=entry_problems(entry),
            warnings=list(entry.get("warnings", [])),
            maker=search.maker(candidate),
        )
        return True

    to_compile = [c for c in order if not cached(c)]
    # A cached plain candidate gets its savers, as a compiled one does.
    for candidate, result in list(search.results.items()):
        for saver in search.savers_of(candidate, result):
            if saver not in to_compile and not cached(saver):
                to_compile.append(saver)
    if topology_mesh.local and processes > 1:
        # Worker processes would have devices of their own, not the job's.
        search.notes.append(
            f"processes={processes} not used: topology='local' compiles for "
            "this job's devices, in this process."
        )
        processes = 1
    workers, executor = _executor(model, processes, len(to_compile), search)
    deadline = None if time_budget is None else began + time_budget
    with (
        _worker_environment(parsed.chips if parsed.platform == "cpu" else None)
        if workers > 1
        else contextlib.nullcontext()
    ):
        try:
            search.run(to_compile, executor, workers, deadline, time_budget)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
    if cache is not None:
        for candidate, result in search.results.items():
            if candidate not in keys:  # a saver added while searching
                keys[candidate] = cache_key(model_part, job.fingerprint(), candidate)
            if result.status == "compiled" and result.compiled is not None:
                cache.store(
                    keys[candidate],
                    result.compiled,
                    chip_memory,
                    result.problems,
                    result.warnings,
                    {"model": made.name, **job.fingerprint(), **candidate.to_dict()},
                )
    title = (
        f"Plan search: {made.name} on {parsed.name} ({devices} x "
        f"{topology_mesh.device_kind}"
        + (f", {parsed.num_slices} slices" if parsed.num_slices > 1 else "")
        + f"), global batch {batch_size}; {len(search.results)} candidates in "
        f"{time.monotonic() - began:.0f} s, {workers} process(es)"
    )
    if job.memory is None:
        search.notes.append(
            "The devices' memory is unknown: whether each fits is unknown, and "
            "candidates are ranked by XLA's peak bytes per device. Pass "
            "device_memory=."
        )
    figures = [r for r in search.results.values() if r.peak_bytes is not None]
    if figures and all(r.step_seconds is None for r in figures):
        search.notes.append(
            "No step time is projected for these devices: ranked by peak bytes."
        )
    ranked = SearchResults(
        list(search.results.values()),
        title=title,
        notes=search.notes,
        seconds=time.monotonic() - began,
        batch_size=batch_size,
        num_slices=parsed.num_slices,
        platform=parsed.platform,
    )
    if largest_batch:
        ranked.largest_batch = best_largest_batch(
            ranked,
            lambda candidate, batch: compile_candidate(
                made, candidate, dataclasses.replace(job, batch_size=batch)
            ),
            batch_size,
            deadline,
        )
        ranked.seconds = time.monotonic() - began
    return ranked


def _executor(
    model: Any, processes: int, count: int, search: _Search
) -> tuple[int, Any]:
    """How many candidates compile at once, and where."""
    wanted = processes
    why_not = _picklable(model) if wanted > 1 else None
    if why_not is not None:
        search.notes.append(f"processes={processes} not used: {why_not}.")
        wanted = 1
    workers = max(1, min(wanted, count))
    if workers == 1:
        return 1, _InThisProcess()
    context = multiprocessing.get_context("spawn")
    return workers, concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)


__all__ = ["Job", "Outcome", "compile_candidate", "compile_in_worker", "plan_search"]
