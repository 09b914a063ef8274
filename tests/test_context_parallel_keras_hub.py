"""Context parallelism (`sequence_axis=`) on KerasHub's decoders, on JAX.

Gemma (with Gemma 2's attention soft cap, final-logit soft cap, sliding window
and query scaling by the model width), Llama and Mistral (grouped-query
attention, rotary positions, Mistral's sliding window, through Keras'
`dot_product_attention`) and GPT-2 (Keras' `MultiHeadAttention`, learned
positions): each a tiny `CausalLM` with no preprocessor, fit for 2 steps on
8 simulated devices with each sequence split along a "seq" mesh axis, on
padded sequences (padding mask and sample weight 0 at the end). The weights
and the loss equal those of plain Keras on one device, and `generate()` after
the fit gives the same tokens, outside the distribution's scope or under it
(where the sequence axis divides the prompts' length). One Gemma also runs
on ("batch", "seq", "model") with KerasHub's layout map. Each attention layer
is the one keras_dist splits: its projections' outputs pass through the
sequence layout during the fit's trace, and in the compiled program each
device computes its own rows of the scores, `[..., sequence / N, sequence]`,
and nothing larger.

KerasHub 0.32 imports on Keras 3.15 only (not on the 3.16 previews): these
tests are skipped, saying so, where `keras_hub` does not import.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.distribution.sequence import attention_layers, split_sequence

pytestmark = pytest.mark.backend("jax")

VOCABULARY = 64
SEQUENCE = 32  # no weight of these models has a dimension of 32
ROWS = 8
BATCH = 4  # 2 steps
PROMPT = 3
GENERATED = 12

# Each model's attention layers, as `attention_layers` finds them.
ATTENTION = {
    "gemma": "decoder_block_{}/attention",
    "llama": "transformer_layer_{}/self_attention",
    "mistral": "transformer_layer_{}/self_attention",
    "gpt2": "transformer_layer_{}/self_attention",
}
# Query heads and head size (the key/value heads are 2).
HEADS = {"gemma": (4, 8), "llama": (4, 4), "mistral": (4, 4), "gpt2": (2, 8)}


def _keras_hub():
    try:
        import keras_hub  # noqa: PLC0415
    except Exception as error:  # ImportError, or a Keras it does not support
        pytest.skip(
            f"keras_hub does not import here ({type(error).__name__}: {error}); "
            "KerasHub 0.32 needs Keras 3.15"
        )
    return keras_hub


def _causal_lm(kind: str) -> keras.Model:
    """A tiny randomly initialised KerasHub causal LM of `kind`, the same
    weights each time: 2 layers, width 16, 4 query and 2 key/value heads
    (GPT-2: 2 heads)."""
    models = _keras_hub().models
    keras.utils.set_random_seed(7)
    common = {
        "vocabulary_size": VOCABULARY,
        "num_layers": 2,
        "hidden_dim": 16,
        "intermediate_dim": 24,
    }
    grouped = {"num_query_heads": 4, "num_key_value_heads": 2, **common}
    if kind == "gemma":
        backbone = models.GemmaBackbone(
            head_dim=8,
            query_head_dim_normalize=False,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            attention_logit_soft_cap=50.0,
            final_logit_soft_cap=30.0,
            use_sliding_window_attention=True,  # on every other layer
            sliding_window_size=8,
            **grouped,
        )
        model = models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    elif kind == "llama":
        backbone = models.LlamaBackbone(**grouped)
        model = models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    elif kind == "mistral":
        backbone = models.MistralBackbone(sliding_window=8, **grouped)
        model = models.MistralCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = models.GPT2Backbone(
            num_heads=2, max_sequence_length=SEQUENCE, **common
        )
        model = models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",  # reproducible
    )
    return model


def _data() -> tuple[dict, np.ndarray, np.ndarray]:
    """Token sequences padded at the end (lengths 24 to 32): the inputs, the
    next-token labels and sample weights, 0 on the padding."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(ROWS, SEQUENCE + 1))
    lengths = rng.integers(SEQUENCE - 8, SEQUENCE + 2, size=(ROWS, 1))
    lengths[0] = SEQUENCE - 8  # the first batch has padding whatever the seed
    mask = np.arange(SEQUENCE + 1) < lengths
    tokens = np.where(mask, tokens, 0).astype("int32")
    inputs = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return inputs, tokens[:, 1:], mask[:, 1:].astype("float32")


def _prompts() -> dict:
    token_ids = np.zeros((2, GENERATED), "int32")
    token_ids[:, :PROMPT] = [[5, 6, 7], [40, 41, 42]]
    return {"token_ids": token_ids, "padding_mask": token_ids > 0}


def _generate(model: keras.Model) -> list:
    generated = model.generate(_prompts(), max_length=GENERATED, stop_token_ids=None)
    return np.asarray(generated["token_ids"]).tolist()


def _fit(model: keras.Model, distribution=None) -> float:
    inputs, labels, weights = _data()
    callbacks = [] if distribution is None else [kd.DistributeCallback(distribution)]
    history = model.fit(
        inputs,
        labels,
        sample_weight=weights,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return history.history["loss"][-1]


@functools.cache
def _reference(kind: str) -> dict:
    """Plain Keras on one device: the loss of the 2 steps, the trained
    weights and the tokens generated after."""
    model = _causal_lm(kind)
    loss = _fit(model)
    return {
        "loss": loss,
        "weights": [np.asarray(v) for v in model.weights],
        "generated": _generate(model),
    }


@pytest.fixture
def constrained(monkeypatch):
    """The layouts the sequence axis gives arrays in a traced step: (sequence
    axis or None for gathered whole, shape), in the order they are hit."""
    import jax  # noqa: PLC0415

    from keras_dist.backends.jax import sequence as jax_sequence  # noqa: PLC0415

    hits = []
    original = jax_sequence.constraint

    def recording(mesh, batch_axis, sequence_axis):
        constrain = original(mesh, batch_axis, sequence_axis)

        def record(outputs):
            array = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
            if isinstance(array, jax.core.Tracer):  # laid out
                hits.append((sequence_axis, tuple(array.shape)))
            return constrain(outputs)

        return record

    monkeypatch.setattr(jax_sequence, "constraint", recording)
    return hits


def _assert_attention_split(model: keras.Model, kind: str, hits: list) -> None:
    """`model`'s two attention layers are the ones found, and the fit's trace
    laid each one's query and output out split, its keys and values whole."""
    assert sorted(_attention_paths(model)) == [
        ATTENTION[kind].format(i) for i in (0, 1)
    ]
    heads, head_dim = HEADS[kind]
    query = (BATCH, SEQUENCE, heads, head_dim)
    key = (BATCH, SEQUENCE, 2, head_dim)
    # Per layer: query split, key and value whole, output split; once per
    # layer in the trace of the train step.
    expected = [
        ("seq", query),
        (None, key),
        (None, key),
        ("seq", (BATCH, SEQUENCE, 16)),
    ]
    assert hits == expected * 2, hits


def _attention_paths(model: keras.Model) -> dict:
    """`model`'s attention layers found by keras_dist, by their variables'
    path (`decoder_block_0/attention`)."""
    return {
        projections["query"].kernel.path.rsplit("/", 2)[0]: layer
        for layer, projections in attention_layers(model)
    }


def _shapes_by_block(text: str, paths: list) -> dict:
    """The shapes of a compiled program's instructions named after the
    decoder block of each attention layer of `paths` (its parent layer), by
    attention path."""
    by_block = {path: [] for path in paths}
    for line in text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%\S+ = [a-z0-9]+\[([\d,]*)\]", line)
        if found is None:
            continue
        shape = tuple(int(size) for size in found.group(1).split(",") if size)
        for path, held in by_block.items():
            if f"/{path.split('/')[0]}/" in line:
                held.append(shape)
    return by_block


def _assert_scores_split(model: keras.Model, distribution) -> None:
    """In the compiled forward pass of `model` under `distribution` (the
    layout `fit` gives its attention), each attention layer computes
    `[..., SEQUENCE / N, SEQUENCE]` scores on each device, and nothing in its
    decoder block is larger (whole scores or a whole `[SEQUENCE, SEQUENCE]`
    mask would be N times larger; XLA may flatten the scores' dimensions)."""
    import jax  # noqa: PLC0415

    mesh = distribution.device_mesh.backend_mesh
    parts = int(mesh.shape[distribution.sequence_axis])
    inputs = _data()[0]
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(distribution.batch_dim_name, "seq")
    )
    inputs = {name: jax.device_put(value, sharding) for name, value in inputs.items()}
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )
    with distribution.scope():
        undo = split_sequence(model, distribution)
        try:
            forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x)[0])
            text = forward.lower(*state, inputs).compile().as_text()
        finally:
            undo()
    by_block = _shapes_by_block(text, list(_attention_paths(model)))
    for path, held in by_block.items():
        rows = [s for s in held if s[-2:] == (SEQUENCE // parts, SEQUENCE)]
        assert rows, (path, sorted(set(held)))
        scores = max(math.prod(s) for s in rows)
        larger = [s for s in held if math.prod(s) > scores]
        assert not larger, (path, scores, larger)


def _assert_like_reference(
    model: keras.Model, loss: float, kind: str, scope=None
) -> None:
    """The loss and the weights of `model` are the one-device fit's, and so
    are the tokens it generates (under `scope` when given: KerasHub lays the
    prompts out as the distribution lays inputs out, split along the
    sequence axis, which must divide their length)."""
    reference = _reference(kind)
    np.testing.assert_allclose(loss, reference["loss"], atol=1e-5, rtol=0)
    for variable, expected in zip(model.weights, reference["weights"], strict=True):
        np.testing.assert_allclose(
            np.asarray(variable), expected, atol=1e-5, rtol=0, err_msg=variable.path
        )
    # Outside the scope, the weights are still laid out on the mesh.
    with contextlib.nullcontext() if scope is None else scope:
        assert _generate(model) == reference["generated"]


@pytest.mark.parametrize(
    "kind, policy, shape, generate_in_scope",
    [
        ("gemma", "DataParallel", (2, 4), True),
        ("llama", "FSDP", (1, 8), False),  # 8 does not divide 12 tokens
        ("mistral", "DataParallel", (1, 8), False),
        ("gpt2", "FSDP", (2, 4), True),
    ],
)
def test_decoder_fits_and_generates_like_one_device(
    kind, policy, shape, generate_in_scope, constrained
):
    mesh = kd.DeviceMesh(shape, ["batch", "seq"])
    if policy == "FSDP":
        distribution = kd.FSDP(mesh, min_size=256, sequence_axis="seq")
    else:
        distribution = kd.DataParallel(mesh, sequence_axis="seq")
    model = _causal_lm(kind)
    loss = _fit(model, distribution)
    _assert_attention_split(model, kind, constrained)
    if policy == "FSDP":  # variables split along the sequence axis too
        specs = [tuple(v.value.sharding.spec) for v in model.weights]
        assert any("seq" in spec for spec in specs), specs
    scope = distribution.scope() if generate_in_scope else None
    _assert_like_reference(model, loss, kind, scope)
    _assert_scores_split(model, distribution)


def test_gemma_with_keras_hub_layouts_and_a_sequence_axis(constrained):
    """("batch", "seq", "model"): KerasHub's layout map splits the heads along
    "model", FSDP the variables along "batch" and "seq", and the sequences
    are split along "seq"."""
    mesh = kd.DeviceMesh((2, 2, 2), ["batch", "seq", "model"])
    model = _causal_lm("gemma")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Gemma's map needs no repair here
        layout_map = kd.layouts.for_keras_hub(model.backbone, mesh)
    distribution = kd.FSDP(layout_map=layout_map, min_size=256, sequence_axis="seq")
    loss = _fit(model, distribution)
    _assert_attention_split(model, "gemma", constrained)
    query = model.backbone.get_layer("decoder_block_0").attention.query_dense.kernel
    assert query.value.sharding.spec[0] == "model"  # the 4 query heads
    _assert_like_reference(model, loss, "gemma", distribution.scope())
    _assert_scores_split(model, distribution)


class _OpsAttention(keras.layers.Layer):
    """Self-attention that calls `keras.ops.dot_product_attention` itself with
    no `flash_attention`, as KerasHub's Llama, Mistral and Gemma do."""

    def build(self, input_shape):
        for name in ("query_dense", "key_dense", "value_dense"):
            dense = keras.layers.EinsumDense("btd,dnh->btnh", (None, 2, 4))
            dense.build(input_shape)
            setattr(self, name, dense)

    def call(self, hidden):
        attended = keras.ops.dot_product_attention(
            self.query_dense(hidden),
            self.key_dense(hidden),
            self.value_dense(hidden),
            is_causal=True,
        )
        return keras.ops.reshape(attended, keras.ops.shape(hidden))


def test_attention_left_to_keras_is_xlas_under_a_sequence_axis(monkeypatch):
    """Keras' JAX backend picks the kernel of a `dot_product_attention` called
    with no `flash_attention` at each call (whatever `keras.config`'s flash
    setting): cuDNN's fused attention where a GPU has it, which refuses a
    query split along the sequence. Under a sequence axis it is told it has
    none, and XLA's attention runs; after the call it chooses again. The
    GPU's answer is simulated; the kernel run is XLA's either way."""
    import jax  # noqa: PLC0415
    from keras.src.backend.jax import nn as jax_nn  # noqa: PLC0415

    monkeypatch.setattr(jax_nn, "_can_use_flash_attention", lambda *a, **k: True)
    asked = []
    original = jax.nn.dot_product_attention

    def recording(*args, implementation=None, **kwargs):
        asked.append(implementation)
        return original(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    keras.utils.set_random_seed(1)
    token_ids = keras.Input((8,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 8)(token_ids)
    hidden = _OpsAttention()(hidden)
    model = keras.Model(token_ids, keras.layers.Dense(VOCABULARY)(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    tokens = np.arange(32, dtype="int32").reshape(4, 8)
    mesh = kd.DeviceMesh((2, 4), ["batch", "seq"])
    distribution = kd.DataParallel(mesh, sequence_axis="seq")
    model.fit(
        tokens,
        tokens,
        batch_size=4,
        verbose=0,
        # Keras' shape inference before the fit (`_symbolic_build`) is left out.
        callbacks=[
            kd.DistributeCallback(distribution),
            keras.callbacks.LambdaCallback(on_train_begin=lambda _: asked.clear()),
        ],
    )
    assert asked and set(asked) == {"xla"}, asked
    asked.clear()
    model.predict(tokens, verbose=0)  # no sequence axis: Keras' own choice
    assert asked[0] == "cudnn", asked
