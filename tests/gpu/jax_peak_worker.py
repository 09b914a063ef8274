"""The planned peak against the measured one, in a process of its own (JAX's
peak is the process'): `kd.plan(model, distribution, topology="local")`
compiles fit's train step for this process' devices, then `fit` runs it and
the device's `peak_bytes_in_use` is read.

Usage: python jax_peak_worker.py OUTPUT_JSON MODEL [offload]
MODEL: `mlp` (4 x Dense(4096), Adam) or `decoder` (a KerasHub Llama-like
decoder of 4 blocks, width 1024, AdamW, mixed_bfloat16).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist as kd  # noqa: E402

BATCH = 16


def _mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4096,))]
        + [keras.layers.Dense(4096, activation="relu") for _ in range(4)]
        + [keras.layers.Dense(10)]
    )
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((BATCH * 2, 4096), "float32")
    return model, x, np.zeros((BATCH * 2, 10), "float32"), {}


def _decoder():
    import keras_hub  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=32000,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=1024,
        intermediate_dim=4096,
        dtype="mixed_bfloat16",
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tokens = np.random.default_rng(0).integers(0, 32000, (BATCH * 2, 513))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((BATCH * 2, 512), "int32"),
    }
    return model, x, tokens[:, 1:].astype("int32"), {"sequence_length": 512}


def main() -> None:
    output, name = sys.argv[1], sys.argv[2]
    options = {"offload": "optimizer"} if sys.argv[3:] == ["offload"] else {}
    model, x, y, plan_options = {"mlp": _mlp, "decoder": _decoder}[name]()
    distribution = kd.DataParallel(**options)
    result: dict = {"model": name, "options": options}
    try:
        # With topology=, the distribution is made on the topology's mesh.
        plan = kd.plan(
            model,
            lambda mesh: kd.DataParallel(mesh, **options),
            topology="local",
            batch_size=BATCH,
            steps=("train",),
            **plan_options,
        )
    except (ValueError, TypeError) as error:
        result["plan_error"] = f"{type(error).__name__}: {error}"
    else:
        result["planned_peak_bytes"] = plan.compiled.peak_bytes
        result["planned_host_peak_bytes"] = plan.compiled.host_peak_bytes
    # keras.Model.fit: KerasHub's own fit converts its inputs with TensorFlow,
    # which the GPU machine lacks.
    keras.Model.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    stats = jax.devices()[0].memory_stats() or {}
    result["measured_peak_bytes"] = stats.get("peak_bytes_in_use")
    with open(output, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
