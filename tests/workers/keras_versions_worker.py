"""One process of the Keras-version jobs (tests/test_keras_versions.py):
what each process did, counted, while keras_dist drove `fit`.

Usage: python keras_versions_worker.py ENTRY[,ENTRY...] OUTPUT_JSON
Several entries run one after the other in the same job (one start-up), each
with a model of its own; the JSON maps each entry to its result.
ENTRY is how the distribution reaches `fit`: `callback` (a DistributeCallback),
`trainer` (`kd.Trainer(distribution=...)`), `trainer_global` (a `kd.Trainer`
under `kd.set_distribution`: the training data's adapter is built while the
distribution is global), `plain_global` (PyTorch: a plain model under
`kd.set_distribution`, which Keras itself drives), `model_parallel_scope`
(PyTorch: a model built inside a sharding `kd.ModelParallel`'s scope, then
trained under it: DTensors).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import keras_versions_scenarios as scenarios  # noqa: E402


class Trainer(kd.Trainer, keras.Model):
    """A functional model with keras_dist's mixin."""


class TorchCounts(keras.callbacks.Callback):
    """PyTorch: the DistributedDataParallel objects wrapping the model, the
    gradient buckets each DDP made from now on all-reduces per step (a
    communication hook doing what DDP's own reducer does, counting; it
    all-reduces each bucket through `torch.distributed.all_reduce`), and the
    `torch.distributed.all_reduce` calls per step (those, and the metric
    states')."""

    def __init__(self):
        super().__init__()
        import torch.distributed as torch_distributed

        self._distributed = torch_distributed
        self._all_reduce = torch_distributed.all_reduce
        self.all_reduces: list[int] = []
        self.gradient_all_reduces: list[int] = []
        self.ddp_wrappers = -1
        self.keras_ddp_model = "absent"
        self._calls = 0
        self._buckets = 0
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        self._ddp = DistributedDataParallel
        self._init = DistributedDataParallel.__init__
        counts = self

        def __init__(ddp, *args, **kwargs):
            counts._init(ddp, *args, **kwargs)

            def counting_hook(state, bucket):
                counts._buckets += 1
                return default_hooks.allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, counting_hook)

        DistributedDataParallel.__init__ = __init__

    def _wrappers(self) -> list:
        from torch.nn.parallel import DistributedDataParallel

        gc.collect()
        return [
            value
            for value in gc.get_objects()
            if isinstance(value, DistributedDataParallel) and value.module is self.model
        ]

    def on_train_begin(self, logs=None):
        def all_reduce(*args, **kwargs):
            self._calls += 1
            return self._all_reduce(*args, **kwargs)

        self._distributed.all_reduce = all_reduce

    def on_train_batch_begin(self, batch, logs=None):
        self._calls = self._buckets = 0

    def on_train_batch_end(self, batch, logs=None):
        self.all_reduces.append(self._calls)
        self.gradient_all_reduces.append(self._buckets)

    def on_epoch_end(self, epoch, logs=None):
        # After validation and the predict and evaluate inside the run (whose
        # step functions Keras 3.16 wraps in DDP as it builds them), while the
        # run is still on.
        self.ddp_wrappers = max(self.ddp_wrappers, len(self._wrappers()))
        if "ddp_model" in vars(self.model):
            self.keras_ddp_model = type(self.model.ddp_model).__name__

    def on_train_end(self, logs=None):
        self._distributed.all_reduce = self._all_reduce
        self._ddp.__init__ = self._init


class DuringTheRun(keras.callbacks.Callback):
    """PyTorch DTensor run: whether Keras' DTensor promotion mode is on and
    how the hidden kernel is held, at the first step."""

    def on_train_batch_end(self, batch, logs=None):
        if hasattr(self, "seen"):
            return
        from keras_dist.keras_compat import torch_trainer

        kernel = self.model.get_layer("hidden").kernel.value
        self.seen = {
            "promotion_mode": torch_trainer.dtensor_promotion_active(),
            "kernel_placements": [str(p) for p in getattr(kernel, "placements", ())],
        }


def _model_parallel() -> kd.ModelParallel:
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"], kd.list_devices())
    layout_map = kd.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    return kd.ModelParallel(layout_map=layout_map)


# PyTorch: the entries whose gradients DDP averages (CUDA's default, chosen
# here by its variable); the others average them after backward (CPU's).
DDP_ENTRIES = ("trainer", "trainer_global")


def run_entry(entry: str) -> dict:
    distribution = kd.DataParallel()
    callbacks = []
    sync = "ddp" if entry in DDP_ENTRIES else "after_backward"
    os.environ["KERAS_DIST_TORCH_GRADIENT_SYNC"] = sync
    if entry == "callback":
        model = scenarios.build()
        callbacks.append(kd.DistributeCallback(distribution))
    elif entry == "trainer":
        model = scenarios.build(Trainer, distribution=distribution)
    elif entry == "trainer_global":
        kd.set_distribution(distribution)
        model = scenarios.build(Trainer)
    elif entry == "plain_global":
        kd.set_distribution(distribution)
        model = scenarios.build()
    elif entry == "model_parallel_scope":
        distribution = _model_parallel()
        with distribution.scope():
            model = scenarios.build()
        built = type(model.get_layer("hidden").kernel.value).__name__
        during = DuringTheRun()
        callbacks += [during, kd.DistributeCallback(distribution)]
    else:
        raise ValueError(entry)
    counts = None
    if keras.backend.backend() == "torch":
        counts = TorchCounts()
        callbacks.append(counts)
    result = scenarios.fit(model, callbacks)
    kd.set_distribution(None)
    if counts is not None:
        result["torch"] = {
            "all_reduces": counts.all_reduces,
            "gradient_all_reduces": counts.gradient_all_reduces,
            "ddp_wrappers": counts.ddp_wrappers,
            "keras_ddp_model": counts.keras_ddp_model,
            "ddp_model_after": type(vars(model).get("ddp_model")).__name__,
            "gradient_sync": sync,
        }
    if entry == "model_parallel_scope":
        result["model_parallel"] = {**during.seen, "kernel_built_as": built}
    return result


def main() -> None:
    entries, output = sys.argv[1].split(","), pathlib.Path(sys.argv[2])
    result = {entry: run_entry(entry) for entry in entries}
    result = result[entries[0]] if len(entries) == 1 else result
    result["process_id"] = kd.process_id()
    output.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
