"""PyTorch ModelParallel (DTensor) through a plain `model.fit`.

An MLP learns scikit-learn's 8x8 handwritten digits (no download) with its two
wide Dense layers sharded between the processes: the first kernel by columns,
the second by rows (the Megatron pattern), so each process holds 1/N of them and
of their Adam moments. `keras_dist.ModelParallel` makes every weight a torch
DTensor for the duration of each `fit`/`evaluate` on a `(batch, model)` mesh of
all the job's processes; DTensor runs the collectives the sharded matmuls need.
With `--batch-axis 2` (4 processes) the rows of each batch are split as well.

    keras-dist launch --nproc-per-node 2 examples/torch_model_parallel.py
    keras-dist launch --nproc-per-node 4 examples/torch_model_parallel.py --batch-axis 2

Every process prints what it holds of the sharded kernels while training, then
the test accuracy and a checksum of the (gathered) weights, which agree.
`KERAS_BACKEND` defaults to `torch` here.
"""

from __future__ import annotations

import argparse
import hashlib
import os

# Must be set before Keras starts its backend.
os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_dist as kd  # noqa: E402

kd.initialize()  # joins the job the launcher (or torchrun, SLURM) describes

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

# Where each variable goes; whatever the map does not name is replicated.
LAYOUTS = {
    "wide_in/kernel": (None, "model"),  # columns split: each process 1/N of them
    "wide_in/bias": ("model",),
    "wide_out/kernel": ("model", None),  # rows split: partial sums all-reduced
}


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    """Digits as (N, 64) float32 in [0, 1]; 80 % train, 20 % test."""
    digits = load_digits()
    features = (digits.data / 16.0).astype("float32")
    return train_test_split(
        features,
        digits.target.astype("int64"),
        test_size=0.2,
        random_state=seed,
        stratify=digits.target,
    )


def build_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(512, activation="relu", name="wide_in"),
            keras.layers.Dense(64, activation="relu", name="wide_out"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="digits_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def model_parallel(batch_axis: int) -> kd.ModelParallel:
    processes = kd.num_processes()
    if processes % batch_axis:
        raise ValueError(
            f"--batch-axis must divide the number of processes ({processes}). "
            f"Received: --batch-axis {batch_axis}"
        )
    mesh = kd.DeviceMesh(
        (batch_axis, processes // batch_axis), ["batch", "model"], kd.list_devices()
    )
    layout_map = kd.LayoutMap(mesh)
    for key, axes in LAYOUTS.items():
        layout_map[key] = axes
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


class ReportShards(keras.callbacks.Callback):
    """What this process holds of each sharded kernel, at the first step."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, tuple[int, ...]] = {}

    def on_train_batch_end(self, batch, logs=None):
        if self.held:
            return
        for variable in self.model.weights:
            value = variable.value
            local = value.to_local() if hasattr(value, "to_local") else value
            if variable.path.endswith("kernel"):
                self.held[variable.path] = tuple(local.shape)


def weight_checksum(model: keras.Model) -> str:
    """The sum of absolute weights, and a digest of their exact bytes."""
    weights = model.get_weights()
    digest = hashlib.sha256()
    for weight in weights:
        digest.update(np.ascontiguousarray(weight).tobytes())
    total = float(sum(np.abs(weight).astype("float64").sum() for weight in weights))
    return f"{total:.6f} (sha256 {digest.hexdigest()[:16]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument(
        "--batch-axis", type=int, default=1, help="mesh size of the batch axis"
    )
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()

    # The same seed everywhere: the same data order on every process (each one
    # reads the whole batch). Process 0's initial weights are the ones sharded.
    keras.utils.set_random_seed(arguments.seed)
    x_train, x_test, y_train, y_test = load_data(arguments.seed)
    distribution = model_parallel(arguments.batch_axis)
    if kd.process_id() == 0:
        print(f"Backend: {keras.backend.backend()}")
        print(
            f"Mesh:    {tuple(distribution.device_mesh.shape)} "
            f"{distribution.device_mesh.axis_names} over {kd.list_devices()}"
        )

    model = build_model()
    shards = ReportShards()
    model.fit(
        x_train,
        y_train,
        batch_size=arguments.batch_size,
        epochs=arguments.epochs,
        validation_data=(x_test, y_test),
        callbacks=[kd.DistributeCallback(distribution), shards],
        verbose=2,  # one line per epoch; only process 0 prints it
    )
    results = model.evaluate(
        x_test,
        y_test,
        batch_size=arguments.batch_size,
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    held = ", ".join(f"{path} {shape}" for path, shape in sorted(shards.held.items()))
    # Every process prints these: its own shards, then the same accuracy and
    # the same weights (gathered back into full arrays after the call).
    print(f"process {kd.process_id()}: held while training: {held}")
    print(
        f"process {kd.process_id()}: final test accuracy {results['accuracy']:.4f}, "
        f"weight checksum {weight_checksum(model)}"
    )


if __name__ == "__main__":
    main()
