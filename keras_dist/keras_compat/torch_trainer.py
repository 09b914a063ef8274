"""Where Keras' PyTorch trainer distributes on its own (Keras 3.16), and how
keras_dist keeps it from doing so a second time in keras_dist's runs.

Keras 3.16's torch `Trainer`, once `torch.distributed` is initialized:

- wraps the model in its own `DistributedDataParallel` when it builds a step
  function (`_initialize_ddp`, into `model.ddp_model`, only while that is
  None), and its steps call `self.ddp_model or self`;
- sums every metric state over the processes in `get_metrics_result`;
- variables created under a distribution whose layout shards them become
  DTensors at creation (`Variable._initialize_distributed`), and
  `set_distribution` of anything but a `DataParallel` enters its
  `KerasDTensorPromotionMode` (a torch dispatch mode).

keras_dist keeps one DistributedDataParallel of its own (it needs `no_sync`
for gradient accumulation, its own error for unused weights, none at all for
a user's own `train_step`) and lends it to Keras for the run (`lend_ddp`),
sums the metric states itself, once, in one flat all-reduce
(`metrics_summed_by_keras_dist`), lays its variables out when a run starts
(`keep_variables_plain`), and mixes DTensors with plain tensors itself
(`leave_dtensor_promotion`). On Keras 3.15 none of this exists and each
function does nothing. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import keras

from keras_dist.keras_compat import backend as keras_backends


def _trainer() -> type:
    return keras_backends.trainer_class("torch")


def _core() -> Any:
    return keras_backends.ops_module("torch")


def _own(cls: type, name: str) -> Any:
    return cls.__dict__.get(name)


# -- one DistributedDataParallel -------------------------------------------------
def keras_wraps_in_ddp() -> bool:
    """Whether Keras' torch trainer wraps the model in DDP itself (3.16)."""
    return _own(_trainer(), "_initialize_ddp") is not None


class _NoKerasDDP:
    """`model.ddp_model` while keras_dist syncs the gradients itself (a user's
    own `train_step`, DTensor runs): not None, so Keras does not wrap the
    model in DDP, and falsy, so Keras' steps call the model itself."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "<keras_dist: no DistributedDataParallel for Keras' steps>"


def lend_ddp(model: Any, ddp: Any | None) -> Callable[[], None]:
    """Until the returned undo, `model.ddp_model` is `ddp` (keras_dist's own
    DistributedDataParallel of `model`) or, with None, a falsy stand-in: Keras
    wraps nothing, and a Keras step the run reaches (a user's
    `super().train_step()`) goes through keras_dist's wrapper or the model.
    What was there before (None, or Keras' DDP from an earlier plain call) is
    put back. Nothing on a Keras whose models have no `ddp_model`."""
    if "ddp_model" not in vars(model):
        return lambda: None
    previous = vars(model)["ddp_model"]
    # Past torch's submodule registration, as Keras sets it.
    object.__setattr__(model, "ddp_model", _NoKerasDDP() if ddp is None else ddp)

    def undo() -> None:
        object.__setattr__(model, "ddp_model", previous)

    return undo


def keep_keras_from_wrapping_over(is_own_group: Callable[[], bool]) -> None:
    """Keras wraps no model in DDP while `is_own_group()` is true: the default
    process group is keras_dist's own one-process group (torch's DeviceMesh
    needs a group; a one-process job never asked for one). Without this, once
    keras_dist made it, every plain Keras model in the process got Keras' DDP
    on its first call, and an unbuilt model's first `predict` failed (`DDP is
    not needed when a module doesn't have any parameter`). Idempotent; nothing
    on a Keras that does not wrap."""
    trainer = _trainer()
    original = _own(trainer, "_initialize_ddp")
    if original is None or hasattr(original, "_keras_dist_original"):
        return

    @functools.wraps(original)
    def _initialize_ddp(self: Any) -> None:
        if is_own_group():
            return
        original(self)

    _initialize_ddp._keras_dist_original = original
    trainer._initialize_ddp = _initialize_ddp


# -- metric states summed once -----------------------------------------------------
def keras_sums_metrics() -> bool:
    """Whether Keras' torch trainer sums the metric states over the processes
    in its own `get_metrics_result` (3.16)."""
    return _own(_trainer(), "get_metrics_result") is not None


# Models whose metric states keras_dist sums (id -> how many runs ask).
_summed_by_keras_dist: dict[int, int] = {}


def _base_metrics_result() -> Callable[[Any], Any] | None:
    """Keras' backend-neutral `get_metrics_result` (its base trainer's), which
    reads this process' metric states only."""
    for cls in _trainer().__mro__[1:]:
        method = cls.__dict__.get("get_metrics_result")
        if method is not None:
            return method
    return None


def _install_metrics_result() -> None:
    trainer = _trainer()
    keras_own = _own(trainer, "get_metrics_result")
    base = _base_metrics_result()
    if (
        keras_own is None
        or base is None  # `check()` names it
        or getattr(keras_own, "_keras_dist_original", None)
    ):
        return

    @functools.wraps(keras_own)
    def get_metrics_result(self: Any) -> Any:
        if id(self) in _summed_by_keras_dist:
            # This process' results from its own states: keras_dist sums them.
            return base(self)
        return keras_own(self)

    get_metrics_result._keras_dist_original = keras_own  # type: ignore[attr-defined]
    trainer.get_metrics_result = get_metrics_result


def _remove_metrics_result() -> None:
    trainer = _trainer()
    ours = _own(trainer, "get_metrics_result")
    original = getattr(ours, "_keras_dist_original", None)
    if original is not None:
        trainer.get_metrics_result = original


def metrics_summed_by_keras_dist(model: Any) -> Callable[[], None]:
    """Until the returned undo, Keras' torch `get_metrics_result` gives
    `model`'s results from this process' own metric states, as Keras 3.15
    does: keras_dist sums them over the processes itself (`metric_sync`),
    and reaches Keras' method from its own steps, from a user's override that
    calls `super()` and from `fit`'s epoch logs alike. Nothing on a Keras
    whose torch trainer does not sum them."""
    if not keras_sums_metrics():
        return lambda: None
    key = id(model)
    _summed_by_keras_dist[key] = _summed_by_keras_dist.get(key, 0) + 1
    _install_metrics_result()

    def undo() -> None:
        count = _summed_by_keras_dist.pop(key, 1) - 1
        if count > 0:
            _summed_by_keras_dist[key] = count
        if not _summed_by_keras_dist:
            _remove_metrics_result()

    return undo


# -- variables and DTensors --------------------------------------------------------
def creates_dtensors_at_init() -> bool:
    """Whether Keras' torch variables become DTensors when created under a
    distribution that shards them (3.16)."""
    return _own(_core().Variable, "_initialize_distributed") is not None


def keep_variables_plain(lays_out_itself: Callable[[Any], bool]) -> None:
    """Keras leaves a torch variable plain at creation, as Keras 3.15 does,
    while the global distribution is one that `lays_out_itself` (keras_dist's
    policies, which lay out torch variables when a run starts; their torch
    layouts are DTensor placements, not the Keras `DTensorLayout` Keras 3.16
    reads). Idempotent; nothing on a Keras without such variables."""
    variable_class = _core().Variable
    original = _own(variable_class, "_initialize_distributed")
    if original is None or getattr(original, "_keras_dist_original", None):
        return

    @functools.wraps(original)
    def _initialize_distributed(self: Any, initializer: Any) -> Any:
        if lays_out_itself(keras.distribution.distribution()):
            return None
        return original(self, initializer)

    _initialize_distributed._keras_dist_original = original  # type: ignore[attr-defined]
    variable_class._initialize_distributed = _initialize_distributed


# -- Keras' DTensor dispatch mode --------------------------------------------------
def _backend_distribution_lib() -> Any:
    try:
        return importlib.import_module("keras.src.backend.torch.distribution_lib")
    except ModuleNotFoundError:
        return None


def keras_promotes_dtensors() -> bool:
    """Whether `set_distribution` enters Keras' `KerasDTensorPromotionMode`
    on torch (3.16)."""
    library = _backend_distribution_lib()
    return (
        library is not None
        and hasattr(library, "deactivate_dtensor_promotion")
        and hasattr(library, "activate_dtensor_promotion")
        and callable(getattr(_core(), "_get_dtensor_promotion_mode", None))
    )


def dtensor_promotion_active() -> bool:
    """Whether Keras' `KerasDTensorPromotionMode` is on in this thread."""
    return (
        keras_promotes_dtensors() and _core()._get_dtensor_promotion_mode() is not None
    )


def leave_dtensor_promotion() -> Callable[[], None]:
    """Leave Keras' `KerasDTensorPromotionMode` until the returned undo.

    The mode runs every torch op through Python to promote plain tensors
    mixed with DTensors; keras_dist lays out and mixes them itself
    (`implicit_replication`), and an op DTensor cannot run must be named in
    keras_dist's error, not hidden behind the mode's dispatch. Nothing when
    the mode is off or Keras has none."""
    if not dtensor_promotion_active():
        return lambda: None
    library = _backend_distribution_lib()
    library.deactivate_dtensor_promotion()
    if dtensor_promotion_active():
        # Another dispatch mode was entered after Keras' (which Keras only
        # leaves from the top of the stack): it stays on.
        return lambda: None
    return library.activate_dtensor_promotion


def check() -> list[str]:
    """On torch, what keras_dist's switches rely on wherever Keras 3.16
    distributes by itself (nothing to find on Keras 3.15)."""
    if keras.backend.backend() != "torch":
        return []
    missing = []
    trainer = _trainer()
    if keras_wraps_in_ddp():
        wrap = inspect.getsource(_own(trainer, "_initialize_ddp"))
        step = inspect.getsource(trainer.train_step)
        if "self.ddp_model is None" not in wrap or "self.ddp_model or self" not in step:
            missing.append(
                "torch Trainer wraps in DDP only while ddp_model is None and "
                "its steps call `self.ddp_model or self`"
            )
        if "ddp_model" not in vars(keras.Sequential()):
            missing.append("torch Trainer.ddp_model (an instance attribute)")
    if keras_sums_metrics() and _base_metrics_result() is None:
        missing.append("BaseTrainer.get_metrics_result")
    if (
        creates_dtensors_at_init()
        and "_initialize_distributed"
        not in inspect.getsource(_core().Variable._initialize_with_initializer)
    ):
        missing.append("torch Variable creates DTensors in _initialize_distributed")
    from keras.src.distribution import distribution_lib  # noqa: PLC0415

    promotes = "activate_dtensor_promotion" in inspect.getsource(
        distribution_lib.set_distribution
    )
    if promotes and not keras_promotes_dtensors():
        missing.append(
            "keras.src.backend.torch.distribution_lib.deactivate_dtensor_promotion"
        )
    return missing
