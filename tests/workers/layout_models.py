"""Models and data the `keras_dist.layouts` tests train, on every backend.

Imported by tests/test_layouts.py and by layouts_worker.py (torch processes).
"""

from __future__ import annotations

import keras
import numpy as np
import worker_seed

import keras_dist as kd

VOCABULARY = 64
SEQUENCE = 8
ROWS = 16
BATCH = 8  # 2 steps an epoch


def tokens(seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Token ids with a full padding mask, and next-token-like targets."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, VOCABULARY, size=(ROWS, SEQUENCE)).astype("int32")
    targets = rng.integers(0, VOCABULARY, size=(ROWS, SEQUENCE)).astype("int32")
    return {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)}, targets


def _compile(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def attention_model(*, conv: bool = True) -> keras.Model:
    """Embedding -> (Conv1D ->) MultiHeadAttention -> Dense -> Dense -> head,
    with per-position logits over the vocabulary."""
    worker_seed.set_random_seed(3)
    token_ids = keras.Input((SEQUENCE,), dtype="int32", name="token_ids")
    hidden = keras.layers.Embedding(VOCABULARY, 8, name="embedding")(token_ids)
    if conv:
        hidden = keras.layers.Conv1D(8, 3, padding="same", name="conv")(hidden)
    hidden = keras.layers.MultiHeadAttention(4, 2, name="attention")(hidden, hidden)
    hidden = keras.layers.Dense(16, activation="relu", name="up")(hidden)
    hidden = keras.layers.Dense(8, name="down")(hidden)
    logits = keras.layers.Dense(VOCABULARY, name="head")(hidden)
    return _compile(keras.Model(token_ids, logits, name="tagger"))


def causal_lm(kind: str, *, key_value_heads: int = 2) -> keras.Model:
    """A tiny randomly initialised KerasHub Gemma or Llama causal LM (no
    preprocessor; its backbone is `model.backbone`)."""
    import keras_hub

    worker_seed.set_random_seed(5)
    common = {
        "vocabulary_size": VOCABULARY,
        "num_layers": 1,
        "num_query_heads": 4,
        "num_key_value_heads": key_value_heads,
        "hidden_dim": 16,
        "intermediate_dim": 32,
    }
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(head_dim=8, name="gemma", **common)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    elif kind == "llama":
        backbone = keras_hub.models.LlamaBackbone(name="llama", **common)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    else:
        raise ValueError(f"Unknown KerasHub model: {kind!r}")
    return _compile(model)


def fit(model: keras.Model, inputs, targets, distribution=None) -> np.ndarray:
    """Two steps of `fit` (under `distribution` when given); the logits of the
    trained model on `inputs`, computed with its variables as they are then
    (still laid out on the mesh on JAX)."""
    callbacks = [] if distribution is None else [kd.DistributeCallback(distribution)]
    model.fit(
        inputs,
        targets,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return keras.ops.convert_to_numpy(model(inputs))


def largest_difference(first: list, second: list) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(first, second, strict=True)
    )
