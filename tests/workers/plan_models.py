"""Models and layout maps for `keras-dist plan MODULE:FUNCTION` in
tests/test_planner.py (imported by the CLI, in its own process)."""

from __future__ import annotations

import keras

import keras_dist as kd


def mlp() -> keras.Model:
    """A 64 -> 256 -> 64 MLP: kernels of 16,384 elements each."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, name="up"),
            keras.layers.Dense(64, name="down"),
        ],
        name="mlp",
    )


def mlp_layout_map(mesh: kd.DeviceMesh) -> kd.LayoutMap:
    """Megatron-style column then row split, plus a key with a typo."""
    layout_map = kd.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    layout_map["upp/bias"] = ("model",)  # matches nothing: a typo
    return layout_map


def mlp_clean_layout_map(mesh: kd.DeviceMesh) -> kd.LayoutMap:
    layout_map = kd.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    return layout_map


def unbuilt_mlp() -> keras.Model:
    """Two Dense(4096) layers and no `keras.Input`: not built (issue 25)."""
    return keras.Sequential(
        [keras.layers.Dense(4096, name="wide"), keras.layers.Dense(4096, name="wider")],
        name="unbuilt",
    )


def llama() -> keras.Model:
    """A tiny KerasHub Llama backbone (hidden 16, 4 query and 2 key/value
    heads, 2 layers): its inputs are (batch, sequence) token ids and mask."""
    import keras_hub  # noqa: PLC0415

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )


def llama_keras_hub_layout(mesh: kd.DeviceMesh) -> kd.LayoutMap:
    """`kd.layouts.for_keras_hub` on a Llama backbone like `llama()`'s (built
    here: `for_keras_hub` reads its variables' shapes)."""
    return kd.layouts.for_keras_hub(llama(), mesh)


def llama_own_layout(mesh: kd.DeviceMesh) -> keras.distribution.LayoutMap:
    """KerasHub's own Llama map, unrepaired (keras-hub#2827)."""
    import keras_hub  # noqa: PLC0415

    return keras_hub.models.LlamaBackbone.get_layout_map(mesh)


#: KerasHub 0.32's backbones with a `get_layout_map` of their own.
KERAS_HUB_WITH_LAYOUTS = ("gemma", "llama", "qwen", "qwen_moe", "qwen3_moe")


def keras_hub_backbone(kind: str) -> keras.Model:
    """A tiny KerasHub backbone of `kind` (one of `KERAS_HUB_WITH_LAYOUTS`):
    hidden 16, 4 query and 2 key/value heads, 2 layers."""
    import keras_hub  # noqa: PLC0415

    models = keras_hub.models
    common = {
        "vocabulary_size": 64,
        "num_layers": 2,
        "num_query_heads": 4,
        "num_key_value_heads": 2,
        "hidden_dim": 16,
        "intermediate_dim": 32,
    }
    experts = {"moe_intermediate_dim": 8, "num_experts": 4, "top_k": 2}
    makers = {
        "gemma": lambda: models.GemmaBackbone(head_dim=8, **common),
        "llama": lambda: models.LlamaBackbone(**common),
        "qwen": lambda: models.QwenBackbone(**common),
        "qwen_moe": lambda: models.QwenMoeBackbone(
            shared_expert_intermediate_dim=16, **experts, **common
        ),
        # Every layer a mixture of experts: KerasHub's keys for the dense
        # feed-forward layers match nothing.
        "qwen3_moe": lambda: models.Qwen3MoeBackbone(head_dim=4, **experts, **common),
    }
    return makers[kind]()


def compiled_mlp() -> keras.Model:
    """`mlp`, compiled: the step the compiled plan compiles needs its loss and
    optimizer."""
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    return model


def mlp_without_loss() -> keras.Model:
    """`mlp`, compiled with an optimizer and no loss."""
    model = mlp()
    model.compile(optimizer="adam")
    return model
