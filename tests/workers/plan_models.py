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
