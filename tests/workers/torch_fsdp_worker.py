"""One process of a PyTorch FSDP job whose model needs more than Dense layers.

Usage: python torch_fsdp_worker.py OUTPUT_JSON

`kd.FSDP` on the batch axis alone computes each layer on plain tensors (this
process' rows, the layer's whole weights). The model here has what that must
still get right: a loss added by a layer (`add_loss`) and an activity
regularizer, both from this process' rows; a weight regularizer; a layer that
reads another layer's kernel (a tied weight); and a frozen layer. It trains
under `kd.FSDP` with an optimizer each process applies to its parts (Adam) and
with one that must see whole gradients (`global_clipnorm`), each against the
same fit on one device in this process.
"""

from __future__ import annotations

import json
import sys

import worker_seed

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402


class AddedLoss(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.1 * ops.mean(ops.square(inputs)))
        return inputs


class Tied(keras.layers.Layer):
    """Multiplies by the transposed kernel of another layer."""

    def __init__(self, other: keras.layers.Layer, **kwargs):
        super().__init__(**kwargs)
        self.other = other

    def call(self, inputs):
        return ops.matmul(inputs, ops.transpose(self.other.kernel))


def build(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    worker_seed.set_random_seed(7)
    inputs = keras.Input((6,))
    first = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(0.01),
        name="first",
    )
    hidden = AddedLoss(name="added_loss")(first(inputs))
    frozen = keras.layers.Dense(8, name="frozen")
    hidden = frozen(hidden)
    frozen.trainable = False
    hidden = keras.layers.Dense(
        8, activity_regularizer=keras.regularizers.L2(0.01), name="regularized"
    )(hidden)
    hidden = Tied(first, name="tied")(hidden)
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=optimizer, loss="categorical_crossentropy")
    return model


def main() -> None:
    rng = np.random.default_rng(0)
    # 45 rows in batches of 12: the last one (9 rows) splits 5 + 4.
    x = rng.normal(size=(45, 6)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 45)]
    result = {}
    for name, optimizer in (
        ("adam", lambda: keras.optimizers.Adam(0.01)),
        ("clipped", lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5)),
    ):
        weights, losses, kinds = [], [], []
        for distribution in (kd.FSDP(min_size=0), None):
            model = build(optimizer())
            first_inputs: list[str] = []

            def record(layer, args, seen=first_inputs):
                if args[0].device.type != "meta":  # not Keras' symbolic build
                    seen.append(f"{type(args[0]).__name__} {list(args[0].shape)}")

            hook = model.get_layer("first").register_forward_pre_hook(record)
            history = model.fit(
                x,
                y,
                batch_size=12,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[kd.DistributeCallback(distribution)] if distribution else [],
            )
            hook.remove()
            weights.append(model.get_weights())
            losses.append(history.history["loss"])
            kinds.append(sorted(set(first_inputs)))
        result[name] = {
            "difference": max(
                float(np.max(np.abs(ours - theirs)))
                for ours, theirs in zip(*weights, strict=True)
            ),
            "losses": losses,
            "fsdp_layer_inputs": kinds[0],
        }
    result["process_id"] = kd.process_id()
    with open(sys.argv[1], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
