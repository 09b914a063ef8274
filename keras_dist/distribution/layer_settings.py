"""What a call under a distribution gives the model's layers, and takes back
when it ends: recomputation (`remat=`, `distribution.remat`), the compute
dtype of a mixed-precision policy (`distribution.mixed_precision`), then the
attention layout of a sequence axis (`distribution.sequence`). A run
(`training.session`) and the compiled plan (`planner.compiled`) apply the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_dist.distribution.mixed_precision import compute_in
from keras_dist.distribution.remat import rematerialize
from keras_dist.distribution.sequence import split_sequence


def apply_layer_settings(
    model: Any, distribution: Any, *, warn: bool, recomputes_state: bool
) -> Callable[[], None]:
    """Give `model`'s layers `distribution`'s remat mode and mixed-precision
    compute dtype (either may be absent); return what undoes both. When one
    raises, what was already applied is undone first.

    Args:
        warn: whether to warn about layers left out (one process warns).
        recomputes_state: whether the backend recomputes a layer that updates
            state exactly (see `remat.rematerialize`).
    """
    undo: list[Callable[[], None]] = []

    def undo_all() -> None:
        while undo:
            undo.pop()()

    try:
        remat = getattr(distribution, "remat", None)
        if remat is not None:
            undo.append(
                rematerialize(
                    model, remat, warn=warn, recomputes_state=recomputes_state
                )
            )
        policy = getattr(distribution, "mixed_precision", None)
        if policy is not None:
            undo.append(compute_in(model, policy, warn=warn))
        if getattr(distribution, "sequence_axis", None) is not None:
            undo.append(split_sequence(model, distribution))
    except BaseException:
        undo_all()
        raise
    return undo_all
