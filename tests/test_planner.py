"""`keras_dist.plan` and `keras-dist plan`: layouts and bytes per device from
shapes only, and every problem class the planner names."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.planner.plan import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mesh(shape, axes):
    count = int(np.prod(shape))
    return kd.DeviceMesh(shape, axes, kd.list_devices()[:count])


def _kinds(result):
    return sorted({problem.kind for problem in result.problems})


def _paths(result, kind):
    return sorted(
        p for problem in result.problems if problem.kind == kind for p in problem.paths
    )


def test_plan_counts_variables_slots_and_activations_on_every_backend():
    def build():
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(5, name="hidden"),
                keras.layers.Dense(3, name="out"),
            ],
            name="net",
        )

    distribution = kd.DataParallel(devices=kd.list_devices()[:1])
    result = plan(
        build,
        distribution,
        batch_size=4,
        optimizer=keras.optimizers.SGD(momentum=0.9),
    )
    params = [row for row in result.rows if row.role == "trainable"]
    assert [(row.path, row.shape) for row in params] == [
        ("net/hidden/kernel", (6, 5)),
        ("net/hidden/bias", (5,)),
        ("net/out/kernel", (5, 3)),
        ("net/out/bias", (3,)),
    ]
    assert all(
        row.key == "unmatched" and row.total_bytes == row.bytes_per_device
        for row in params
    )
    # SGD with momentum: one slot per trainable variable, shaped like it.
    momenta = [row for row in result.rows if row.path.endswith("_momentum")]
    assert sorted(row.shape for row in momenta) == sorted(row.shape for row in params)
    device = result.devices[0]
    assert device.parameters == 4 * (30 + 5 + 15 + 3)
    # Activations: inputs (4x6) and the two outputs (4x5, 4x3), float32.
    assert device.activations == 4 * 4 * (6 + 5 + 3)
    assert result.problems == []
    if kd.list_devices()[0].startswith("cpu"):
        # No backend reports a CPU device's memory.
        assert device.memory is None
        assert any("memory is unknown" in note for note in result.notes)


@pytest.mark.backend("jax")
def test_a_160_gb_model_is_planned_without_allocating_it():
    def huge():
        return keras.Sequential(
            [keras.Input((200_000,)), keras.layers.Dense(200_000, name="huge")],
            name="big",
        )

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = plan(
        huge,
        kd.FSDP(devices=kd.list_devices()),
        batch_size=8,
        device_memory=16 * 2**30,
        optimizer="adam",
    )
    kernel = next(row for row in result.rows if row.path == "big/huge/kernel")
    assert kernel.total_bytes == 200_000 * 200_000 * 4
    assert kernel.bytes_per_device == kernel.total_bytes // 8
    # Adam: a first and a second moment per trainable variable, laid out alike.
    # (The optimizer is "adam", "adam_1"... by how many this process made.)
    slots = [
        row
        for row in result.rows
        if row.path.endswith(("/big_huge_kernel_momentum", "/big_huge_kernel_velocity"))
    ]
    assert [row.axes for row in slots] == [kernel.axes, kernel.axes]
    # Later stateless scopes (every functional build ends one) must not
    # initialise the planned variables either.
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="after")])
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2**20, f"planning grew the process by {grown_kib} KiB"
    assert _kinds(result) == ["out-of-memory"]
    assert "big/huge/kernel" in result.problems[0].paths


@pytest.mark.backend("jax")
def test_fsdp_holds_one_nth_of_every_large_variable_per_device():
    from tests.workers.plan_models import mlp

    model = mlp()
    model.compile(optimizer="adam")
    devices = kd.list_devices()
    replicated = plan(model, kd.DataParallel(devices=devices))
    sharded = plan(model, kd.FSDP(devices=devices, min_size=1024))
    for full, fsdp in zip(replicated.rows, sharded.rows, strict=True):
        assert full.path == fsdp.path
        large = np.prod(full.shape) >= 1024
        assert fsdp.bytes_per_device == (
            full.bytes_per_device // 8 if large else full.bytes_per_device
        )
    replicated_kernels = sum(
        r.bytes_per_device for r in replicated.rows if "kernel" in r.path
    )
    sharded_kernels = sum(
        r.bytes_per_device for r in sharded.rows if "kernel" in r.path
    )
    assert sharded_kernels * 8 == replicated_kernels  # parameters and Adam slots


@pytest.mark.backend("jax")
def test_layout_map_problems_are_each_named():
    token_ids = keras.Input((8,), dtype="int32", name="token_ids")
    hidden = keras.layers.Embedding(64, 16, name="token_embedding")(token_ids)
    query = keras.layers.EinsumDense("btd,dnh->btnh", (8, 4, 4), name="query")(hidden)
    up = keras.layers.Dense(32, name="ffw_up")(hidden)
    down = keras.layers.Dense(16, name="ffw_down")(up)
    projection = keras.layers.Dense(16, name="proj")
    outputs = projection(down)
    model = keras.Model(token_ids, [outputs, query], name="toy")
    projection.enable_lora(2)
    layout_map = kd.LayoutMap(_mesh((4, 2), ["batch", "model"]))
    layout_map["query/kernel"] = ("model", "batch", None)  # keras-hub#2827
    layout_map["proj/.*kernel"] = (None, "model")  # catches LoRA (keras#19496)
    layout_map["ffw_up/ker"] = (None, "model")
    layout_map["up/kernel$"] = (None, "model")
    layout_map["ffw_down/kernel"] = ("model", None, None)
    layout_map["missing_layer/kernel"] = ("model",)
    result = plan(model, kd.ModelParallel(layout_map=layout_map), batch_size=2)
    assert _kinds(result) == [
        "mixed-roles",
        "multiple-keys",
        "swapped-axes",
        "too-many-axes",
        "unmatched-key",
    ]
    assert _paths(result, "swapped-axes") == ["query/kernel"]
    assert _paths(result, "mixed-roles") == [
        "proj/kernel",
        "proj/lora_kernel_a",
        "proj/lora_kernel_b",
    ]
    assert _paths(result, "multiple-keys") == ["ffw_up/kernel"]
    multiple = next(p for p in result.problems if p.kind == "multiple-keys")
    assert "'ffw_up/ker'" in multiple.message and "'up/kernel$'" in multiple.message
    assert _paths(result, "too-many-axes") == ["ffw_down/kernel"]
    assert _paths(result, "unmatched-key") == ["missing_layer/kernel"]
    rows = {row.path: row for row in result.rows}
    assert rows["ffw_down/kernel"].axes == (None, None)  # planned replicated
    assert rows["query/kernel"].bytes_per_device == 16 * 4 * 4 * 4 // 8
    assert rows["token_embedding/embeddings"].key == "unmatched"


@pytest.mark.backend("jax")
def test_keras_hub_gemma_map_is_not_flagged_but_its_single_kv_head_is_indivisible():
    keras_hub = pytest.importorskip("keras_hub")

    def gemma():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=16,
            intermediate_dim=32,
            head_dim=8,
        )

    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], kd.list_devices())
    distribution = kd.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    )
    with pytest.raises(ValueError) as raised:
        plan(gemma, distribution)
    message = str(raised.value)
    for expected in (
        "decoder_block_0/attention/key/kernel",
        "dimension 0 (size 1",
        "mesh axis 'model' (size 2)",
        "on_indivisible='replicate'",
    ):
        assert expected in message
    result = plan(gemma, distribution, on_indivisible="replicate")
    # keras-hub#1613: one key/value head over 2 model shards; nothing else.
    assert _kinds(result) == ["indivisible"]
    assert _paths(result, "indivisible") == sorted(
        f"decoder_block_{i}/attention/{name}/kernel"
        for i in (0, 1)
        for name in ("key", "value")
    )
    rows = {row.path: row for row in result.rows}
    assert rows["decoder_block_0/attention/key/kernel"].axes == (None, "batch", None)
    assert rows["decoder_block_0/attention/query/kernel"].axes == (
        "model",
        "batch",
        None,
    )
    assert rows["token_embedding/embeddings"].bytes_per_device == 64 * 16 * 4 // 8


@pytest.mark.backend("jax")
def test_plan_prints_a_table_serialises_and_plots(tmp_path, monkeypatch):
    from tests.workers.plan_models import mlp, mlp_layout_map

    distribution = kd.FSDP(layout_map=mlp_layout_map(_mesh((4, 2), ["batch", "model"])))
    result = plan(
        mlp, distribution, batch_size=8, device_memory=10**6, optimizer="adam"
    )
    text = str(result)
    for expected in (
        "mlp/up/kernel",
        "('batch', 'model')",
        "Per device",
        "unmatched-key",
        "upp/bias",
    ):
        assert expected in text
    assert (
        json.loads(json.dumps(result.to_dict()))["problems"][0]["kind"]
        == "unmatched-key"
    )
    png = tmp_path / "plan.png"
    assert result.plot(str(png)) == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(ImportError, match=r'pip install "keras-dist\[plan\]"'):
        str(result)
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "keras-dist\[plan\]"'):
        result.plot(str(tmp_path / "again.png"))


@pytest.mark.backend("jax")
def test_bad_arguments_are_named():
    from tests.workers.plan_models import mlp

    distribution = kd.DataParallel(devices=kd.list_devices()[:1])
    with pytest.raises(ValueError, match="on_indivisible"):
        plan(mlp, distribution, on_indivisible="drop")
    with pytest.raises(ValueError, match="batch_size"):
        plan(mlp, distribution, batch_size=0)
    with pytest.raises(TypeError, match="device_memory"):
        plan(mlp, distribution, device_memory="16GB")
    with pytest.raises(TypeError, match="distribution"):
        plan(mlp, "data parallel")
    with pytest.raises(TypeError, match="a Keras model"):
        plan(lambda: "not a model", distribution)

    def compiled():
        model = mlp()
        model.compile(optimizer="adam")
        return model

    with pytest.raises(ValueError, match="optimizer="):
        plan(compiled, distribution)


@pytest.mark.backend("jax")
def test_cli_plans_a_mesh_larger_than_the_machine(tmp_path, monkeypatch, capsys):
    from keras_dist.cli import parse_memory

    assert parse_memory("16GB") == 16 * 10**9 and parse_memory("2GiB") == 2 * 2**30
    with pytest.raises(ValueError, match="--device-memory"):
        parse_memory("lots")
    environment = {**os.environ, "KERAS_DIST_CPU_DEVICES": "8", "KERAS_BACKEND": "jax"}
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "plan",
        "tests.workers.plan_models:mlp",
    ]
    command += [
        "--mesh",
        "4,4",
        "--axes",
        "batch,model",
        "--fsdp",
        "--batch-size",
        "32",
    ]
    png = tmp_path / "plan.png"
    failing = subprocess.run(
        [
            *command,
            "--layout-map",
            "tests.workers.plan_models:mlp_layout_map",
            "--json",
            "--png",
            str(png),
            "--device-memory",
            "10KB",
            "--optimizer",
            "adam",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=environment,
    )
    assert failing.returncode == 1, failing.stderr[-2000:]
    report = json.loads(failing.stdout.strip().splitlines()[-1])
    assert [d["device"] for d in report["devices"]] == [f"cpu:{i}" for i in range(16)]
    assert sorted(p["kind"] for p in report["problems"]) == [
        "out-of-memory",
        "unmatched-key",
    ]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The clean case in this process (no second start-up): exit code 0.
    from keras_dist import cli

    monkeypatch.chdir(ROOT)
    arguments = command[3:] + [
        "--layout-map",
        "tests.workers.plan_models:mlp_clean_layout_map",
    ]
    assert cli.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "mlp/up/kernel" in printed and "No problems found." in printed


@pytest.mark.backend("jax")
def test_slot_table_matches_keras_optimizers_built_on_shapes():
    # TensorFlow's optimizers take real variables only; there the planner
    # counts slots from this table, so it must say what building says.
    from keras_dist.planner import slots

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m"
    )
    optimizers = [getattr(keras.optimizers, name)() for name in slots.SLOT_TABLE]
    optimizers += [
        keras.optimizers.SGD(momentum=0.9),
        keras.optimizers.Adam(amsgrad=True, use_ema=True),
        keras.optimizers.RMSprop(momentum=0.5, centered=True),
    ]
    stand_ins = [
        slots._StandIn(v.path, tuple(v.shape), v.dtype)
        for v in model.trainable_variables
    ]
    from_table = set()
    for optimizer in optimizers:
        built, note = slots.optimizer_slots(model, optimizer)
        table, _ = slots._from_table(optimizer, stand_ins, RuntimeError("test"))
        if "building a copy" not in note:
            from_table.add(type(optimizer).__name__)
            continue
        owned = sorted((s.path, s.shape, s.owner) for s in built if s.owner)
        assert owned == sorted((s.path, s.shape, s.owner) for s in table), optimizer
    # Nadam makes a variable with a value in build(), which a stateless
    # scope refuses: the table is its only count.
    assert from_table == {"Nadam"}
