"""Whether a rank failed on its own, or may have failed because another rank
did: what the rank writes in its error report, for `keras-dist launch`.

When two ranks fail, the second is not always the first one's consequence:
both may raise the same `ValueError` on the same bad batch, or hit the same
operator DTensor cannot run. A rank's failure follows from another's only
when the rank learned of that failure before it raised, and a rank learns of
it in two ways: when the other rank's process ends (its connections close,
and a collective, a rendezvous, a store or the coordination service in
progress fails), or when it is told to end (`lifecycle.announce_end`, after
which it writes no error report at all). So, from what the rank knows when
its exception reaches the excepthook, its failure is its own when

1. no other rank of the job on its node had ended (their pids are in the
   launcher's job directory; a process ends, for the kernel, before its
   peers' sockets see it close, let alone before they raise); or
2. its exception was raised in the program's own code: outside the job's
   runtime (torch, jax, jaxlib, tensorflow, and keras_dist, which drives
   them), with no exception from inside it in its chain (`__cause__`,
   `__context__`: code that reacts to a failed collective by raising its own
   error still reacts to it). Another rank's end shows up only inside the
   runtime, so such an exception was not caused by it, even when a slower
   rank raises it after the other rank ended.

Otherwise (another rank had ended and the exception came from the runtime) it
may be a consequence, and the launcher calls it one when another rank failed
first. Check 1 errs on that side: a rank that raised on its own just before
its peer ended, and reached the excepthook after, counts as a consequence
unless check 2 says otherwise. Ranks on other nodes cannot be seen: their
launcher names their failures.

Where an exception comes from (check 2): the module of its type (JAX and
TensorFlow raise runtime errors of their own types, and their frames may be
filtered out of the traceback, as Keras filters TensorFlow's), else the
module of the innermost frame of its traceback (a gloo error is a plain
`RuntimeError` raised under `torch.distributed`). An operator of a backend
called straight from the program's own frame and failing there (a shape error
in a custom `train_step`) counts as the program's own: no peer's end shows up
that way.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from keras_dist.cluster.job_dir import read_rank_pids

# The top-level packages where another rank's end shows up.
RUNTIME_PACKAGES = frozenset({"torch", "jax", "jaxlib", "tensorflow", "keras_dist"})


def is_own_failure(exception: BaseException, peers_ended: list[int] | None) -> bool:
    """Whether this rank's uncaught `exception` is a failure of its own (see
    the module docstring).

    Args:
        exception: the rank's uncaught exception.
        peers_ended: the other ranks of the job on this node that had ended
            when it reached the excepthook (`ended_peers`); None when they are
            unknown (no launcher), and then only where it was raised decides.

    Example:

    >>> is_own_failure(RuntimeError("Connection reset by peer"), peers_ended=[])
    True
    """
    if peers_ended is not None and not peers_ended:
        return True
    return raised_in_own_code(exception)


def raised_in_own_code(exception: BaseException) -> bool:
    """Whether `exception` and every exception in its chain were raised
    outside the job's runtime (check 2 of the module docstring).

    Example:

    >>> try:
    ...     raise ValueError("bad labels")
    ... except ValueError as error:
    ...     raised_in_own_code(error)
    True
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exception]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if _in_runtime(type(current).__module__) or _in_runtime(
            _innermost_module(current.__traceback__)
        ):
            return False
        pending.extend(
            linked
            for linked in (current.__cause__, current.__context__)
            if linked is not None
        )
    return True


def ended_peers(
    job_directory: str | None, rank: int, is_running: Callable[[int], bool]
) -> list[int] | None:
    """The other ranks of the launcher's job directory whose process is no
    longer running (`is_running(pid)`), in rank order; None without a job
    directory or when it names no rank (nothing is known then)."""
    if job_directory is None:
        return None
    pids = read_rank_pids(job_directory)
    if not pids:
        return None
    return [
        peer
        for peer, pid in sorted(pids.items())
        if peer != rank and not is_running(pid)
    ]


def _innermost_module(trace: TracebackType | None) -> str:
    """The module whose code raised: that of the traceback's last frame."""
    if trace is None:
        return ""
    while trace.tb_next is not None:
        trace = trace.tb_next
    return str(trace.tb_frame.f_globals.get("__name__", ""))


def _in_runtime(module: str) -> bool:
    return module.partition(".")[0] in RUNTIME_PACKAGES
