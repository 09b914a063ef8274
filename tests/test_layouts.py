"""`keras_dist.layouts`: tensor-parallel and KerasHub layout maps that train
like one device (JAX, 8 simulated devices; PyTorch, 2 processes)."""

from __future__ import annotations

import sys
import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import layouts
from tests.multiprocess import WORKERS, log_of, run_job

sys.path.insert(0, str(WORKERS))
import layout_models  # noqa: E402


@pytest.fixture(autouse=True)
def _warnings_anew(monkeypatch):
    """`for_keras_hub` warns once per message and process: each test here sees
    its own warnings, whatever ran before it in this process."""
    from keras_dist.common import job

    monkeypatch.setattr(job, "_warned", set())


def _mesh(batch: int, model: int) -> kd.DeviceMesh:
    return kd.DeviceMesh((batch, model), ["batch", "model"])


def _value(model: keras.Model, path: str):
    (variable,) = [v for v in model.weights if v.path == path]
    return variable.value


def _assert_same_weights(model: keras.Model, reference: keras.Model) -> None:
    for ours, expected in zip(
        model.get_weights(), reference.get_weights(), strict=True
    ):
        np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)


def _axes(layout_map) -> dict[str, tuple]:
    return {key: tuple(layout_map[key].axes) for key in layout_map}


@pytest.mark.backend("jax")
def test_tensor_parallel_keys_split_columns_then_rows():
    model = layout_models.attention_model()
    layout_map = layouts.tensor_parallel(model, _mesh(2, 4))
    # MHA's heads (4) split; the head's 64 columns too; Conv1D's 8 channels.
    assert _axes(layout_map) == {
        "^embedding/embeddings$": (None, "model"),
        "^conv/kernel$": (None, None, "model"),
        "^conv/bias$": ("model",),
        "^attention/query/kernel$": (None, "model", None),
        "^attention/query/bias$": ("model", None),
        "^attention/key/kernel$": (None, "model", None),
        "^attention/key/bias$": ("model", None),
        "^attention/value/kernel$": (None, "model", None),
        "^attention/value/bias$": ("model", None),
        "^attention/attention_output/kernel$": ("model", None, None),
        "^attention/attention_output/bias$": (None,),
        "^up/kernel$": (None, "model"),
        "^up/bias$": ("model",),
        "^down/kernel$": ("model", None),
        "^down/bias$": (None,),
        "^head/kernel$": (None, "model"),
        "^head/bias$": ("model",),
    }
    assert layout_map.replicated == {}
    assert layout_map.device_mesh.shape == (2, 4)
    # A model axis of 3 divides none of these dimensions but the conv's 3-wide
    # window (not split): every split variable is replicated and reported.
    mesh = kd.DeviceMesh((1, 3), ["batch", "model"], kd.list_devices()[:3])
    odd = layouts.tensor_parallel(model, mesh)
    assert all(set(axes) == {None} for axes in _axes(odd).values())
    assert odd.replicated["up/kernel"] == (
        "dimension 1 of shape (8, 16) is 16, which the 'model' axis of size 3 "
        "does not divide"
    )
    assert "up/bias" in odd.replicated and "down/bias" not in odd.replicated


@pytest.mark.backend("jax")
def test_tensor_parallel_bad_input_is_named():
    mesh = _mesh(2, 4)
    model = layout_models.attention_model(conv=False)
    with pytest.raises(ValueError, match=r"`model_axis` must be an axis .*'heads'"):
        layouts.tensor_parallel(model, mesh, model_axis="heads")
    with pytest.raises(TypeError, match="must be a Keras model.*Dense"):
        layouts.tensor_parallel(keras.layers.Dense(3), mesh)
    with pytest.raises(ValueError, match="must be built.*'unbuilt'"):
        unbuilt = keras.Sequential([keras.layers.Dense(3)], name="unbuilt")
        layouts.tensor_parallel(unbuilt, mesh)
    with pytest.raises(TypeError, match="must be a DeviceMesh"):
        layouts.tensor_parallel(model, (2, 4))
    with pytest.raises(ValueError, match="`data_axis` must be an axis"):
        layouts.for_keras_hub(model, mesh, data_axis="data")
    # No get_layout_map of its own: tensor_parallel, with a warning.
    with pytest.warns(UserWarning, match="Functional has no `get_layout_map`"):
        fallback = layouts.for_keras_hub(model, mesh)
    assert _axes(fallback) == _axes(layouts.tensor_parallel(model, mesh))


class _Projection(keras.layers.Layer):
    """A kernel and a second variable whose path extends the kernel's."""

    def build(self, input_shape):
        self.kernel = self.add_weight((input_shape[-1], 3), name="kernel")
        self.kernel_scale = self.add_weight((4, 2), name="kernel_scale")

    def call(self, inputs):
        return inputs @ self.kernel


class _Backbone(keras.Model):
    """A model with a KerasHub-style `get_layout_map` (a regex per role)."""

    @staticmethod
    def get_layout_map(
        device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"
    ):
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map["projection.*kernel.*"] = (None, model_parallel_dim_name)
        return layout_map


class _NoLayouts(keras.Model):
    @staticmethod
    def get_layout_map(device_mesh, **axes):
        raise NotImplementedError("no layouts")


@pytest.mark.backend("jax")
def test_for_keras_hub_repair_keeps_every_other_lookup():
    """KerasHub's keys match whole paths; the repaired kernel's exact key,
    searched as a regex, would also match `kernel_scale`, which KerasHub's key
    matches too: it gets its own key."""
    inputs = keras.Input((4,))
    outputs = _Projection(name="projection")(inputs)
    backbone = _Backbone(inputs, outputs, name="net")
    with pytest.warns(UserWarning, match="'projection/kernel' cannot be used"):
        layout_map = layouts.for_keras_hub(backbone, _mesh(4, 2))
    assert _axes(layout_map) == {
        "^(?:projection.*kernel.*)$": (None, "model"),
        "projection/kernel": (None, None),
        "projection/kernel_scale": (None, "model"),
    }
    assert list(layout_map.replicated) == ["projection/kernel"]
    model = _NoLayouts(inputs, outputs, name="plain")
    with pytest.warns(UserWarning, match="_NoLayouts has no `get_layout_map`"):
        fallback = layouts.for_keras_hub(model, _mesh(4, 2))
    assert list(fallback) == []  # tensor_parallel knows no custom layer


@pytest.mark.backend("jax")
def test_tensor_parallel_trains_like_one_device():
    inputs, targets = layout_models.tokens()
    token_ids = inputs["token_ids"]
    reference = layout_models.attention_model()
    expected = layout_models.fit(reference, token_ids, targets)
    model = layout_models.attention_model()
    distribution = kd.ModelParallel(
        layout_map=layouts.tensor_parallel(model, _mesh(2, 4))
    )
    logits = layout_models.fit(model, token_ids, targets, distribution)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    _assert_same_weights(model, reference)
    # Trained split: each device of a model group holds 1 of the 4 heads.
    query = model.get_layer("attention").query_dense.kernel.value
    assert query.sharding.shard_shape(query.shape) == (8, 1, 2)
    down = model.get_layer("down").kernel.value
    assert down.sharding.shard_shape(down.shape) == (4, 8)


def _llama_attention(layers=(0,)):
    return [
        f"transformer_layer_{i}/self_attention/{name}/kernel"
        for i in layers
        for name in ("query", "key", "value")
    ]


def test_for_keras_hub_swaps_back_keras_hubs_swapped_llama_axes():
    """keras-hub#2827: KerasHub's Llama map gives the query/key/value kernels,
    (hidden, heads, head_dim), Gemma's (model, data, None): the model axis on
    the width. Swapped back, then repaired like any other layout (2 key/value
    heads do not split 4 ways); Gemma's own map is left as it is."""
    pytest.importorskip("keras_hub")
    from tests.workers.plan_models import keras_hub_backbone

    # Placeholder devices: nothing runs, so every backend can lay out (2, 4).
    mesh = kd.DeviceMesh((2, 4), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
    backbone = keras_hub_backbone("llama")
    with pytest.warns(UserWarning) as record:
        layout_map = layouts.for_keras_hub(backbone, mesh)
    attention = _llama_attention((0, 1))
    assert list(layout_map.swapped) == attention
    messages = [str(warning.message) for warning in record]
    for path in attention:
        assert any(f"{path!r} cannot be used" in m for m in messages), messages
        assert "the model width (size 16)" in layout_map.swapped[path]
        assert "keras-hub#2827" in layout_map.swapped[path]
    queries, keys_values = attention[::3], [p for p in attention if "query" not in p]
    for path in queries:
        assert layout_map[path].axes == ("batch", "model", None)
    for path in keys_values:
        assert layout_map[path].axes == ("batch", None, None)
        assert "is 2, which the 'model' axis of size 4" in layout_map.replicated[path]
    # Everything else as KerasHub lays it out.
    hub_map = type(backbone).get_layout_map(mesh)
    for variable in backbone.weights:
        if variable.path in attention or variable.path in layout_map.replicated:
            continue
        ours, theirs = layout_map[variable.path], hub_map[variable.path]
        assert (ours and ours.axes) == (theirs and theirs.axes), variable.path
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Gemma's map needs no swap
        gemma_map = layouts.for_keras_hub(
            keras_hub_backbone("gemma"),
            kd.DeviceMesh((4, 2), ["batch", "model"], [f"cpu:{i}" for i in range(8)]),
        )
    assert gemma_map.swapped == {}


@pytest.mark.backend("jax")
def test_llama_trains_like_one_device_with_keras_hub_layouts():
    inputs, targets = layout_models.tokens()
    reference = layout_models.causal_lm("llama")
    expected = layout_models.fit(reference, inputs, targets)
    model = layout_models.causal_lm("llama")
    with pytest.warns(UserWarning, match="keras-hub#2827"):
        layout_map = layouts.for_keras_hub(model.backbone, _mesh(2, 4))
    hub_map = type(model.backbone).get_layout_map(_mesh(2, 4))
    attention = _llama_attention()
    assert list(layout_map.swapped) == attention
    assert list(layout_map.replicated) == attention[1:]  # 2 key/value heads
    for variable in model.backbone.weights:  # the others as KerasHub lays them out
        if variable.path not in attention:
            ours, theirs = layout_map[variable.path], hub_map[variable.path]
            assert (ours and ours.axes) == (theirs and theirs.axes), variable.path
    logits = layout_models.fit(
        model, inputs, targets, kd.ModelParallel(layout_map=layout_map)
    )
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    _assert_same_weights(model, reference)
    # KerasHub's ("model", "batch") on a (2, 4) mesh: 4 x 2 blocks of (32, 16).
    ffw = _value(model, "transformer_layer_0/feedforward_output_dense/kernel")
    assert ffw.sharding.shard_shape(ffw.shape) == (8, 8)
    # The query kernel (16, 4, 4), swapped back: the width along "batch" (2),
    # the heads along "model" (4).
    query = _value(model, attention[0])
    assert query.sharding.shard_shape(query.shape) == (8, 1, 4)


@pytest.mark.backend("jax")
def test_gemma_with_one_key_value_head_is_repaired_and_trains_like_one_device():
    """keras-hub#1613: KerasHub splits the key/value heads (here 1) along the
    model axis (here 2)."""
    inputs, targets = layout_models.tokens()
    reference = layout_models.causal_lm("gemma", key_value_heads=1)
    expected = layout_models.fit(reference, inputs, targets)
    model = layout_models.causal_lm("gemma", key_value_heads=1)
    with pytest.warns(UserWarning) as record:
        layout_map = layouts.for_keras_hub(model.backbone, _mesh(4, 2))
    repaired = [f"decoder_block_0/attention/{name}/kernel" for name in ("key", "value")]
    messages = [str(warning.message) for warning in record]
    for path in repaired:
        assert any(f"{path!r} cannot be used" in m for m in messages), messages
        assert layout_map[path].axes == (None, "batch", None)
        assert "dimension 0 of shape (1, 16, 8) is 1" in layout_map.replicated[path]
    assert sorted(layout_map.replicated) == sorted(repaired)
    # The query kernels keep KerasHub's layout.
    assert layout_map["decoder_block_0/attention/query/kernel"].axes == (
        "model",
        "batch",
        None,
    )
    logits = layout_models.fit(
        model, inputs, targets, kd.ModelParallel(layout_map=layout_map)
    )
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    _assert_same_weights(model, reference)
    # Trained with the repaired layout: split along "batch" (4) only.
    key = _value(model, "decoder_block_0/attention/key/kernel")
    assert key.sharding.shard_shape(key.shape) == (1, 4, 8)


@pytest.mark.backend("torch")
def test_torch_tensor_parallel_and_llama_train_like_one_process(tmp_path):
    """What DTensor cannot run (split Conv1D variables, an embedding table split
    along the vocabulary) is replicated; the rest is split and trains."""
    results = run_job(
        "layouts_worker.py",
        ["train"],
        processes=2,
        env={"KERAS_BACKEND": "torch"},
        output_dir=tmp_path,
    )
    for result in results:
        for case in ("tensor_parallel", "llama"):
            assert result[case]["weights"] < 1e-5, result
            assert result[case]["logits"] < 1e-5, result
        tensor_parallel, llama = result["tensor_parallel"], result["llama"]
        assert tensor_parallel["replicated"] == {}
        conv_replicated = result["conv_replicated"]
        assert sorted(conv_replicated) == ["conv/bias", "conv/kernel"]
        assert "cannot run a convolution" in conv_replicated["conv/bias"]
        held = tensor_parallel["held"]
        assert held["attention/query/kernel"] == [[8, 2, 2], ["R", "S(1)"]]
        assert held["down/kernel"] == [[8, 8], ["R", "S(0)"]]
        assert held["embedding/embeddings"] == [[64, 4], ["R", "S(1)"]]
        assert "conv/kernel" not in held
        assert list(llama["replicated"]) == ["token_embedding/embeddings"]
        assert "along its rows" in llama["replicated"]["token_embedding/embeddings"]
        # KerasHub's ("model", "batch"): rows split in 2, the batch axis is 1.
        assert llama["held"]["transformer_layer_0/feedforward_output_dense/kernel"] == [
            [16, 16],
            ["S(1)", "S(0)"],
        ]
    # Values Partial along both axes (that kernel's matmul) are summed in one
    # all-reduce over the mesh's processes, not one per axis, which DTensor
    # warned about on every rank: "While redistributing from (Partial(sum),
    # Partial(sum)) to (Replicate(), Replicate()), 2 sequential all_reduce
    # operations will be performed. This is suboptimal: ...".
    for rank in (0, 1):
        log = log_of(tmp_path, rank)
        assert "While redistributing" not in log, log
        assert "operations will be performed" not in log, log
