"""What `keras_dist.plan_search` returns: each candidate's outcome, ranked,
and the ranked table."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from keras_dist.planner.candidates import POLICIES, REMAT, Candidate
from keras_dist.planner.result import CompiledPlan, Plan, Problem
from keras_dist.planner.search_cache import compiled_to_dict

_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
#: How a candidate came out: compiled now, read from the cache, found too
#: large before compiling (`screened`), failed with an exception, or not
#: tried (`skipped`, with the reason).
STATUSES = ("compiled", "cached", "screened", "failed", "skipped")


@dataclass
class SearchResult:
    """One candidate of a search and what came of it.

    Attributes:
        candidate: the `Candidate` (policy, mesh, remat).
        status: one of `STATUSES`.
        compiled: XLA's figures (`CompiledPlan`), when compiled or cached.
        plan: the whole `Plan` when compiled in this process, else None.
        error: the exception a failed candidate raised (type and message).
        reason: why a candidate was screened out or skipped.
        problems: the static plan's problems (`Problem`s).
        warnings: what making its distribution or compiling warned.
        seconds: wall seconds spent on it (0 from the cache).
        rank: 1 for the best; None for a candidate that failed or was not
            tried.
        screened_shortfall: for a screened candidate, the bytes per device
            its variables and optimizer state alone exceed the memory by.
    """

    candidate: Candidate
    status: str
    compiled: CompiledPlan | None = None
    plan: Plan | None = field(default=None, repr=False)
    error: str | None = None
    reason: str | None = None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rank: int | None = None
    screened_shortfall: int | None = None
    maker: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    _distribution: Any = field(default=None, repr=False, compare=False)

    @property
    def description(self) -> str:
        """Policy, mesh and remat, e.g. `"FSDP x TP, batch=64 model=4, remat off"`."""
        return self.candidate.description

    @property
    def policy(self) -> str:
        return self.candidate.policy

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.candidate.mesh)

    @property
    def remat(self) -> str | None:
        return self.candidate.remat

    @property
    def fits(self) -> bool | None:
        """Whether it fits each device (None: the memory is unknown, or it
        was not compiled)."""
        if self.status == "screened":
            return False
        return None if self.compiled is None else self.compiled.fits

    @property
    def peak_bytes(self) -> int | None:
        return None if self.compiled is None else self.compiled.peak_bytes

    @property
    def margin_bytes(self) -> int | None:
        return None if self.compiled is None else self.compiled.margin_bytes

    @property
    def shortfall_bytes(self) -> int | None:
        """Bytes per device it is short of fitting (needed - available): XLA's
        peak against the memory, or for a screened candidate its static
        plan's variables and optimizer state; None when it fits or this is
        not known (XLA refused it, the memory is unknown)."""
        if self.status == "screened":
            return self.screened_shortfall
        margin = self.margin_bytes
        return -margin if margin is not None and margin < 0 else None

    @property
    def step_seconds(self) -> float | None:
        return None if self.compiled is None else self.compiled.step_seconds

    @property
    def mfu(self) -> float | None:
        return None if self.compiled is None else self.compiled.mfu

    @property
    def compile_seconds(self) -> float | None:
        """XLA's compile time of the steps compiled (when it was compiled,
        also for a cached result)."""
        if self.compiled is None:
            return None
        return sum(step.compile_seconds for step in self.compiled.steps.values())

    @property
    def distribution(self) -> Any:
        """The candidate's distribution on the topology's mesh, ready for
        `DistributeCallback` where the topology is this machine's (`cpu:N`);
        made on first use. A tensor-parallel layout map names the variable
        paths of the model the search made: a model made again for
        training must name its layers the same (KerasHub models do)."""
        if self._distribution is None and self.plan is not None:
            self._distribution = self.plan.made_distribution
        if self._distribution is None and self.maker is not None:
            self._distribution = self.maker()
        return self._distribution

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "candidate": self.candidate.to_dict(),
            "description": self.description,
            "status": self.status,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "margin_bytes": self.margin_bytes,
            "shortfall_bytes": self.shortfall_bytes,
            "step_seconds": self.step_seconds,
            "mfu": self.mfu,
            "compile_seconds": self.compile_seconds,
            "seconds": self.seconds,
            "error": self.error,
            "reason": self.reason,
            "problems": [p.kind for p in self.problems],
            "warnings": list(self.warnings),
            "compiled": None
            if self.compiled is None
            else compiled_to_dict(self.compiled),
        }


def _fit_order(result: SearchResult) -> int:
    if result.status in ("failed", "skipped"):
        return 3 if result.status == "failed" else 4
    fits = result.fits
    return 0 if fits is True else 1 if fits is None else 2


def stable_key(candidate: Candidate) -> tuple:
    """The candidates' own order (policy, mesh, remat): ties are broken by
    it, never by the order in which compiles finished."""
    return (
        POLICIES.index(candidate.policy),
        tuple(candidate.mesh.items()),
        REMAT.index(candidate.remat),
        candidate.offload or "",
        candidate.optimizer_state_dtype or "",
    )


def rank_key(result: SearchResult) -> tuple:
    """Fits first (then unknown, then does not fit), then the projected step
    time, then the peak per device (where no time is projected: CPUs). The
    candidates that do not fit: by their shortfall (needed - available),
    the nearest to fitting first; then those XLA refused (no peak); then
    those screened out before compiling, by their static shortfall. Ties go
    by `stable_key`, so the order is the same from run to run."""
    order = _fit_order(result)
    stable = stable_key(result.candidate)
    if order == 2:
        short = result.shortfall_bytes
        screened = result.status == "screened"
        return (order, screened, short is None, short or 0, 0, stable)
    step = result.step_seconds if order < 2 else None
    peak = result.peak_bytes if order < 2 else None
    return (order, step is None, step or 0.0, peak is None, peak or 0, stable)


class SearchResults:
    """The candidates of a `keras_dist.plan_search`, best first.

    Iterate it, index it or `len()` it for the `SearchResult`s; print it
    for the ranked table. `best` is the first that fits (or, where the
    devices' memory is unknown, the first compiled); `not_tried` the
    candidates the time budget left out; `largest_batch` the largest global
    batch the best fits (`planner.batch_search.LargestBatch`), when the
    search was asked for it (`largest_batch=True`), else None.
    """

    def __init__(
        self,
        results: list[SearchResult],
        *,
        title: str,
        notes: list[str],
        seconds: float,
        batch_size: int | None = None,
        num_slices: int = 1,
        platform: str = "tpu",
    ):
        self.results = sorted(results, key=rank_key)
        self.batch_size = batch_size
        self.num_slices = num_slices
        self.platform = platform
        rank = 0
        for result in self.results:
            if result.status in ("failed", "skipped"):
                continue
            rank += 1
            result.rank = rank
        self.title = title
        self.notes = notes
        self.seconds = seconds
        self.largest_batch: Any = None

    def __iter__(self) -> Iterator[SearchResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, index: int) -> SearchResult:
        return self.results[index]

    @property
    def best(self) -> SearchResult | None:
        first = self.results[0] if self.results else None
        if first is None or first.compiled is None or first.fits is False:
            return None
        return first

    @property
    def not_tried(self) -> list[SearchResult]:
        return [r for r in self.results if r.status == "skipped"]

    @property
    def failed(self) -> list[SearchResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def nearest(self) -> SearchResult | None:
        """When nothing fits, the candidate nearest to fitting (the smallest
        shortfall), else None."""
        if self.best is not None:
            return None
        short = [r for r in self.results if r.shortfall_bytes is not None]
        return short[0] if short else None

    def next_steps(self) -> list[str]:
        """When nothing fits, what to try next, said as `plan_search`'s
        arguments: the nearest candidate, and what would close its gap (a
        smaller batch, remat, more chips) with the figures behind each."""
        nearest = self.nearest
        if nearest is None:
            return []
        short = nearest.shortfall_bytes
        lines = [
            f"Nothing fits. The nearest: {nearest.description}, "
            f"{_bytes(short)} short per device. To close the gap, try:"
        ]
        more = (
            f"num_slices={2 * self.num_slices}, or a topology= of more chips"
            if self.platform == "tpu"
            else "a topology= of more devices"
        )
        if nearest.status == "screened":
            lines.append(
                "  - more chips: its variables and optimizer state alone do not "
                "fit (a smaller batch or remat cannot help); FSDP splits them "
                f"over every chip ({more})"
            )
            return lines
        train = nearest.compiled.train
        if self.batch_size and self.batch_size > 1 and train.temp_bytes:
            lines.append(
                f"  - a smaller batch (batch_size={self.batch_size // 2}): XLA's "
                f"temporaries, {_bytes(train.temp_bytes)} of its peak, shrink "
                "with it"
            )
        if nearest.remat is None:
            lines += self._remat_step(nearest)
        if train.argument_bytes:
            lines.append(
                f"  - more chips: the step's arguments (variables, optimizer "
                f"state, the batch) take {_bytes(train.argument_bytes)} of its "
                f"peak, and FSDP splits the state over every chip ({more})"
            )
        return lines

    def _remat_step(self, nearest: SearchResult) -> list[str]:
        """Remat for the nearest candidate (remat off), unless its remat-on
        twin was compiled (its row says how far that is)."""
        twins = [
            r
            for r in self.results
            if r.candidate.policy == nearest.candidate.policy
            and r.mesh == nearest.mesh
            and r.remat is not None
        ]
        tried = [r for r in twins if r.status != "skipped"]
        if tried:
            return []
        if twins:
            return [f"  - remat: {twins[0].description} was {twins[0].reason}"]
        return [
            "  - remat: recomputing the activations in the backward pass keeps "
            "fewer alive; add Candidate("
            f"{nearest.policy!r}, {nearest.mesh}, remat='full') to candidates="
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "seconds": self.seconds,
            "notes": list(self.notes),
            "next_steps": self.next_steps(),
            "results": [result.to_dict() for result in self.results],
        }

    def __str__(self) -> str:
        return render_table(self)

    def __repr__(self) -> str:
        best = self.best
        return (
            f"<SearchResults {len(self.results)} candidates, best: "
            f"{best.description if best else None}>"
        )


def _bytes(count: float | None) -> str:
    if count is None:
        return "-"
    sign = "-" if count < 0 else ""
    count = abs(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return (
                f"{sign}{count:.0f} {unit}"
                if unit == "B"
                else f"{sign}{count:.1f} {unit}"
            )
        count /= 1024
    return f"{sign}{count:.1f} TiB"


def _one_line(text: str, limit: int = 400) -> str:
    """`text` (an error, Keras' with terminal colours) on one line."""
    plain = " ".join(_COLOURS.sub("", text).split())
    return plain if len(plain) <= limit else plain[: limit - 3] + "..."


def _fits_text(result: SearchResult) -> str:
    if result.status == "skipped":
        return "skipped"
    if result.status == "failed":
        return "failed"
    if result.status == "screened":
        return "no (static)"
    refused = [s for s in result.compiled.steps.values() if s.error]
    if result.fits is False and refused:
        return "no (XLA)"
    if result.fits is None:
        return "unknown"
    return f"yes, {_bytes(result.margin_bytes)} spare" if result.fits else "no"


def _row(result: SearchResult) -> list[str]:
    candidate = result.candidate
    step = result.step_seconds
    compile_seconds = result.compile_seconds
    return [
        str(result.rank) if result.rank is not None else "-",
        candidate.label,
        candidate.mesh_text,
        candidate.description.split(", remat ", 1)[1],
        _fits_text(result),
        _bytes(result.shortfall_bytes),
        _bytes(result.peak_bytes),
        "-" if step is None else f"{step * 1e3:.3g} ms",
        "-" if result.mfu is None else f"{100 * result.mfu:.1f}%",
        "-"
        if compile_seconds is None
        else f"{compile_seconds:.1f} s"
        + (" (cached)" if result.status == "cached" else ""),
    ]


HEADER = [
    "rank",
    "candidate",
    "mesh",
    "remat",
    "fits",
    "short",
    "peak/device",
    "step time",
    "MFU",
    "compile",
]


def render_table(
    results: SearchResults, say: Callable[[str], str] | None = None
) -> str:
    """The ranked table, then why each candidate below it failed or was
    not tried, then the notes and, when nothing fits, what to try next
    (`say` words those for where they are shown: the command's flags)."""
    say = say or (lambda text: text)
    rows = [HEADER] + [_row(result) for result in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = [results.title]
    for row in rows:
        lines.append(
            "  ".join(
                cell.rjust(width) if index in (0, 5, 6, 7, 8, 9) else cell.ljust(width)
                for index, (cell, width) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    for result in results:
        said = result.error or result.reason
        if said is None and result.compiled is not None:
            refused = [s for s in result.compiled.steps.values() if s.error]
            said = f"XLA: {refused[0].error}" if refused else None
        if said:
            lines.append(f"* {result.description}: {_one_line(said)}")
        elif result.warnings:
            lines.append(
                f"* {result.description}: {len(result.warnings)} warning(s) (its "
                f".warnings), the first: {_one_line(result.warnings[0], 200)}"
            )
    lines += [say(f"* {note}") for note in results.notes]
    lines += [say(line) for line in results.next_steps()]
    return "\n".join(lines)


__all__ = ["STATUSES", "SearchResult", "SearchResults", "rank_key", "render_table"]
