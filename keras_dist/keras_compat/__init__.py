"""Every touch of Keras' private API, one module per concern, and the probe.

keras_dist reaches into Keras only here (and in each backend's
`backends/<name>/keras_internals.py`, for that backend's trainer). Each module
has a `check()` that names what it relies on and no longer finds; `check()`
below runs them all, and `tests/test_keras_internals.py` fails loudly when a
Keras release moves one. Where Keras releases differ (3.15 and 3.16), the
module for that concern detects what the installed Keras has (`backend`: the
moved op modules and renamed trainer classes; `data_adapters`: who shards and
how they shuffle; `epoch_iterator`: what one execution reads; `torch_trainer`:
Keras 3.16's own torch DDP, metric sums and DTensors); `versions` refuses a
Keras older than the supported range with one clear error.

What importing keras_dist patches (`patch_keras`, called once by
`keras_dist/__init__.py`):

- `keras.Model.fit`, `evaluate` and `predict` run inside keras_dist's context
  manager, which ends a distributed run with its call, also when it raises
  (`model_calls.run_model_calls_within`);
- the `__init__` of every Keras data adapter marks that it is running, so
  that keras_dist's policies read `auto_shard_dataset` as False there (Keras
  3.16's adapters would shard keras_dist's data a second time) and
  `Distribution.distribute_dataset` knows Keras 3.15 is its caller
  (`data_adapters.mark_keras_data_adapter`).

What keras_dist patches later, and only while it is needed:

- during every `fit`, `evaluate` and `predict` on JAX: the model's
  `_purge_model_variables`, which keeps the values Keras' trainer takes off
  the variables for its steps, to give them back if the call raises
  (`model_calls.values_kept`);
- when a distributed call starts: the model's step functions
  (`steps.install_cached_steps`), each BatchNormalization layer's moments
  (`batch_norm.replace_moments`), with a distribution's `remat=` the
  rematerialization mode of the layers it recomputes (`remat.set_mode`) and
  each recomputed call (`remat.recompute_whole_calls` on JAX, a layer's own
  mode included; `remat.wrap_recomputed_calls` on PyTorch),
  Keras' metric classes' `update_state`
  (`metrics.install_row_aware_metrics`: unchanged outside keras_dist's
  steps), the epoch iterator's batch source (`epoch_iterator.EpochRouting`),
  the backend `distribution_lib` Keras relays layer outputs through
  (`distribution.route_output_layouts`, a proxy); on PyTorch with Keras 3.16
  also the model's `ddp_model` (`torch_trainer.lend_ddp`), the torch
  trainer's `get_metrics_result` for that model
  (`torch_trainer.metrics_summed_by_keras_dist`), and Keras' DTensor dispatch
  mode is left (`torch_trainer.leave_dtensor_promotion`); on JAX with a
  distribution's `offload=` or `optimizer_state_dtype=`, each optimizer
  that updates the model's variables has its `_backend_update_step` run
  within keras_dist's and each `update_step` it calls wrapped (Keras' own
  update runs: `optimizers.hook_updates`), and its slots are made as
  `optimizers.each_new_slot` says;
- when a job of several processes starts: Keras' `save_model` and
  `save_weights`, `BackupAndRestore`, `file_utils.makedirs` and, on processes
  other than 0, the file-writing callbacks (`saving`, `callbacks`);
- for a `kd.Checkpoint` or `kd.callbacks.Throughput`: the epoch iterator's
  enumeration (`epoch_iterator`);
- when a backend's adapter loads: that backend's trainer hooks, in
  `backends/<name>/keras_internals.py` (on PyTorch with Keras 3.16, torch
  variables stay plain at creation under a keras_dist policy:
  `torch_trainer.keep_variables_plain`; on TensorFlow, each
  `TFEpochIterator` records the dataset it built).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_dist.keras_compat import versions

# A Keras older than the supported range, or one that moved what these modules
# import, is one clear error here (not a raw ImportError from inside them).
versions.require_supported_keras()
try:
    from keras_dist.keras_compat import (
        abstract_models,
        backend,
        batch_norm,
        callbacks,
        data_adapters,
        distribution,
        epoch_iterator,
        layers,
        metrics,
        model_calls,
        optimizers,
        remat,
        saving,
        torch_trainer,
        variables,
    )
except ImportError as error:
    raise versions.unsupported(f"it has no {error.name or error}") from error

_PROBED_MODULES = (
    backend,
    distribution,
    model_calls,
    layers,
    remat,
    optimizers,
    batch_norm,
    variables,
    data_adapters,
    saving,
    callbacks,
    metrics,
    epoch_iterator,
    torch_trainer,
    abstract_models,
)


def patch_keras(*, around_model_calls: Callable[[Any, str, Any, dict], Any]) -> None:
    """Apply the patches importing keras_dist applies (idempotent); see the
    module docstring. `around_model_calls(model, name, callbacks, arguments)`
    is the context manager every `fit`, `evaluate` and `predict` runs in."""
    model_calls.run_model_calls_within(around_model_calls)
    data_adapters.mark_keras_data_adapter()


def check() -> list[str]:
    """Names of the backend-neutral Keras details this release no longer
    matches (empty when all are where keras_dist expects them)."""
    missing: list[str] = []
    for module in _PROBED_MODULES:
        missing += module.check()
    return missing
