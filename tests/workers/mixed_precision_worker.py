"""One process of a PyTorch job training under a sharded mixed-precision policy.

Usage: python mixed_precision_worker.py OUTPUT_JSON

A float32 model trained under `kd.FSDP(mixed_precision=...)` on the processes
of the job, against the same model built under Keras' `mixed_bfloat16` policy
(trained under `kd.FSDP` without a policy, and on one device in this process
with plain Keras), and with the gradients summed in float32. What each layer
reads its kernel from while it runs (the whole value FSDP gathered) is
recorded: bfloat16 when the gather is. A reduce dtype where DTensor computes
(a kernel split along a model axis) is refused when the run starts and leaves
the model trainable by plain Keras.
"""

from __future__ import annotations

import json
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402

SAMPLES, BATCH, EPOCHS = 48, 16, 2


class Recording(keras.layers.Dense):
    """A Dense layer that records the dtype of the tensor its kernel holds
    while it runs."""

    seen: list[str] = []

    def call(self, inputs):
        Recording.seen.append(str(self.kernel._value.dtype).replace("torch.", ""))
        return super().call(inputs)


def build(policy: str) -> keras.Model:
    keras.mixed_precision.set_global_policy(policy)
    try:
        worker_seed.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((16,)),
                Recording(64, activation="relu", name="first"),
                keras.layers.Dense(64, activation="relu", name="second"),
                keras.layers.Dense(4, name="logits"),
            ]
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    y = rng.integers(0, 4, size=(SAMPLES,))
    return x, y


def train(model: keras.Model, distribution=None) -> dict:
    Recording.seen = []
    callbacks = [kd.DistributeCallback(distribution)] if distribution else []
    history = model.fit(
        *data(),
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "loss": history.history["loss"],
        "kernel_read_as": sorted(set(Recording.seen)),
        "policies": [layer.dtype_policy.name for layer in model.layers],
    }


def main(output: str) -> None:
    results = {
        "one_device_mixed": train(build("mixed_bfloat16")),
        "fsdp_mixed_built": train(build("mixed_bfloat16"), kd.FSDP(min_size=64)),
        "fsdp_policy": train(
            build("float32"), kd.FSDP(min_size=64, mixed_precision="bfloat16")
        ),
        "fsdp_policy_f32_reduce": train(
            build("float32"),
            kd.FSDP(
                min_size=64,
                mixed_precision=kd.MixedPrecisionPolicy(
                    "bfloat16", reduce_dtype="float32"
                ),
            ),
        ),
        "float32": train(build("float32")),
    }
    # A kernel split along a model axis computes through DTensor: a reduce
    # dtype of its own is refused before the first step.
    mesh = kd.DeviceMesh((1, 2), ["batch", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["first/kernel"] = (None, "model")
    refused = build("float32")
    before = [np.asarray(w) for w in refused.get_weights()]
    try:
        train(
            refused,
            kd.ModelParallel(
                layout_map=layout_map,
                mixed_precision=kd.MixedPrecisionPolicy(
                    "bfloat16", reduce_dtype="float32"
                ),
            ),
        )
        results["refused"] = None
    except NotImplementedError as error:
        results["refused"] = str(error)
    results["refused_unchanged"] = all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(before, refused.get_weights(), strict=True)
    )
    results["refused_then_plain"] = train(refused)["loss"]
    results["process_id"] = kd.process_id()
    with open(output, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])
