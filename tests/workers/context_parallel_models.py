"""The decoder and data of the context-parallelism tests
(`tests/test_context_parallel.py`), shared with their multi-process worker
(`context_parallel_worker.py`)."""

from __future__ import annotations

import keras
import numpy as np
import worker_seed

import keras_dist as kd

VOCABULARY, WIDTH, HEADS = 32, 16, 4
LENGTH = 16  # tokens a sequence: the seq axes used here (2, 4, 8) divide it
SAMPLES, BATCH = 16, 8  # two steps of 8 sequences


def decoder(
    length: int | None = LENGTH, *, flash_attention: bool | None = None, base=None
) -> keras.Model:
    """Tokens and a padding mask in, logits per token out."""
    worker_seed.set_random_seed(3)
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    mask = keras.Input((length,), dtype="bool", name="padding_mask")
    hidden = keras.layers.Embedding(VOCABULARY, WIDTH, name="embed")(tokens)
    attended = keras.layers.MultiHeadAttention(
        HEADS, WIDTH // HEADS, name="attention", flash_attention=flash_attention
    )(hidden, hidden, value_mask=mask, use_causal_mask=True)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden + attended)
    hidden = keras.layers.Dense(2 * WIDTH, activation="gelu", name="up")(hidden)
    hidden = keras.layers.Dense(WIDTH, name="down")(hidden)
    logits = keras.layers.Dense(VOCABULARY, name="logits")(hidden)
    inputs = {"tokens": tokens, "padding_mask": mask}
    model = (base or keras.Model)(inputs, logits, name="decoder")
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        weighted_metrics=["sparse_categorical_accuracy"],
    )
    return model


def data(samples: int = SAMPLES, length: int = LENGTH):
    """Token ids, a padding mask (each row padded at its end to a length of
    its own) as the mask input and as the targets' sample weights."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, (samples, length)).astype("int32")
    lengths = rng.integers(length // 2, length + 1, samples)
    mask = np.arange(length)[None, :] < lengths[:, None]
    targets = np.roll(tokens, -1, axis=1) * mask
    x = {"tokens": tokens * mask, "padding_mask": mask}
    return x, targets, mask.astype("float32")


def run(model: keras.Model, callbacks: list, *, fit_only: bool = False) -> dict:
    """One epoch of `fit`, then (unless `fit_only`) `evaluate` and `predict`,
    under `callbacks`."""
    x, y, weights = data()
    history = model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    ).history
    ran = {"weights": [np.asarray(w) for w in model.get_weights()], "history": history}
    if fit_only:
        return ran
    evaluated = model.evaluate(
        x,
        y,
        sample_weight=weights,
        batch_size=BATCH,
        verbose=0,
        return_dict=True,
        callbacks=[c for c in callbacks if isinstance(c, kd.DistributeCallback)],
    )
    predicted = model.predict(
        x,
        batch_size=BATCH,
        verbose=0,
        callbacks=[c for c in callbacks if isinstance(c, kd.DistributeCallback)],
    )
    return dict(ran, evaluate=evaluated, predict=np.asarray(predicted))
