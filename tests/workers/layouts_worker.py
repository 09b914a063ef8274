"""One process of a PyTorch job training with `keras_dist.layouts` maps.

Usage: python layouts_worker.py train OUTPUT_JSON

Each process trains the models on its own device first (the reference), then
under ModelParallel on a (1, N) ("batch", "model") mesh of all processes, and
reports the largest differences of weights and logits, with attention computed
by torch's math kernel (see `main`).
"""

from __future__ import annotations

import json
import pathlib
import sys

import keras_dist as kd

kd.initialize()

import keras  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from keras_dist import layouts  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import layout_models  # noqa: E402


class RecordShards(keras.callbacks.Callback):
    """[local shape, placements] of each sharded variable during training."""

    def __init__(self):
        super().__init__()
        self.held: dict[str, list] = {}

    def on_train_batch_end(self, batch, logs=None):
        for variable in self.model.weights:
            value = variable.value
            if isinstance(value, DTensor):
                self.held[variable.path] = [
                    list(value.to_local().shape),
                    [str(placement) for placement in value.placements],
                ]


def _compare(build, make_layout_map, inputs, targets) -> dict:
    reference = build()
    expected = layout_models.fit(reference, inputs, targets)
    model = build()
    layout_map = make_layout_map(model)
    distribution = kd.ModelParallel(layout_map=layout_map)
    record = RecordShards()
    callback = kd.DistributeCallback(distribution)
    model.fit(
        inputs,
        targets,
        batch_size=layout_models.BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[record, callback],
    )
    # The sharded forward pass, gathered on every process.
    logits = model.predict(
        inputs, batch_size=layout_models.BATCH, verbose=0, callbacks=[callback]
    )
    return {
        "weights": layout_models.largest_difference(
            model.get_weights(), reference.get_weights()
        ),
        "logits": layout_models.largest_difference([logits], [expected]),
        "held": record.held,
        "replicated": layout_map.replicated,
    }


def train() -> dict:
    mesh = kd.DeviceMesh((1, kd.num_processes()), ["batch", "model"])
    inputs, targets = layout_models.tokens()
    # Not trained: DTensor cannot run a Conv1D whose input arrives split along
    # its channels (after the split Embedding) either.
    with_conv = layouts.tensor_parallel(layout_models.attention_model(), mesh)
    return {
        "conv_replicated": with_conv.replicated,
        "tensor_parallel": _compare(
            lambda: layout_models.attention_model(conv=False),
            lambda model: layouts.tensor_parallel(model, mesh),
            inputs["token_ids"],
            targets,
        ),
        "llama": _compare(
            lambda: layout_models.causal_lm("llama"),
            lambda model: layouts.for_keras_hub(model.backbone, mesh),
            inputs,
            targets,
        ),
    }


def main() -> None:
    scenario, output = sys.argv[1], sys.argv[2]
    if scenario != "train":
        raise ValueError(f"Unknown scenario: {scenario!r}")
    # keras_dist's sharded step picks the attention kernel DTensor can run on
    # CPU (see dtensor.py); the worker does nothing about it.
    result = train()
    with open(output, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
