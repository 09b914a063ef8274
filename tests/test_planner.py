"""`keras_dist.plan` and `keras-dist plan`: layouts and bytes per device from
shapes only, and every problem class the planner names."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import warnings

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

    # A model function may compile its model: its optimizer's slots count.
    result = plan(compiled, distribution)
    trainable = sum(r.total_bytes for r in result.rows if r.role == "trainable")
    slots = sum(r.total_bytes for r in result.rows if r.role == "optimizer")
    assert slots >= 2 * trainable


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


# -- issue 25: what the plan did not see, it says --------------------------------


class _TwoDense(keras.Model):
    """A subclassed model: built only when called; `unused` never is."""

    def __init__(self, units: int = 64, *, unused: bool = False):
        super().__init__(name="two_dense")
        self.first = keras.layers.Dense(units, name="first")
        self.second = keras.layers.Dense(units, name="second")
        self.unused = keras.layers.Dense(3, name="unused") if unused else None

    def call(self, inputs):
        return self.second(self.first(inputs))


def _one_device():
    return kd.DataParallel(devices=kd.list_devices()[:1])


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.Sequential([keras.layers.Dense(4096), keras.layers.Dense(4096)]),
        _TwoDense,
    ],
    ids=["sequential-without-input", "subclassed-never-called"],
)
def test_an_unbuilt_model_is_refused_not_planned_empty(make):
    from keras_dist.planner.model import UnbuiltModelError

    for model in (make, make()):  # a function returning it, and the model itself
        with pytest.raises(UnbuiltModelError) as raised:
            plan(model, _one_device(), device_memory=2**20)
        message = str(raised.value)
        assert "is not built" in message and "a plan of it would be empty" in message
        assert "pass input_shape=" in message
        assert message.endswith("Received: input_shape=None")
        assert isinstance(raised.value, ValueError)


def test_an_unbuilt_model_is_built_from_input_shape():
    from tests.workers.plan_models import unbuilt_mlp

    # The case: two Dense(4096) against a 1 MiB budget.
    result = plan(
        unbuilt_mlp,
        _one_device(),
        input_shape=(4096,),
        batch_size=2,
        device_memory=2**20,
    )
    assert [(row.path, row.shape) for row in result.rows] == [
        ("unbuilt/wide/kernel", (4096, 4096)),
        ("unbuilt/wide/bias", (4096,)),
        ("unbuilt/wider/kernel", (4096, 4096)),
        ("unbuilt/wider/bias", (4096,)),
    ]
    assert result.devices[0].parameters == 4 * 2 * (4096 * 4096 + 4096)
    assert result.devices[0].activations == 2 * 4 * 3 * 4096  # input and 2 outputs
    assert _kinds(result) == ["out-of-memory"]
    # A subclassed model is built by a symbolic call; a layer it never calls
    # is named, not silently left out.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras' own warning about `unused`
        result = plan(lambda: _TwoDense(unused=True), _one_device(), input_shape=(5,))
    assert [row.path for row in result.rows] == [
        "two_dense/first/kernel",
        "two_dense/first/bias",
        "two_dense/second/kernel",
        "two_dense/second/bias",
    ]
    assert _kinds(result) == ["unbuilt"]
    assert result.problems[0].paths == ("unused",)
    # A model object (not a function) is built for real, as a call would.
    model = _TwoDense(8)
    plan(model, _one_device(), input_shape=(5,))
    assert model.built
    assert np.any(keras.ops.convert_to_numpy(model.first.kernel.value) != 0)


def test_keras_hub_backbone_activations_from_sequence_length_or_input_shape():
    from tests.workers.plan_models import llama

    unsized = plan(llama, _one_device(), batch_size=8)
    assert unsized.devices[0].activations is None
    assert any(
        "(None, None)" in note and "sequence_length=" in note for note in unsized.notes
    )
    by_length = plan(llama, _one_device(), batch_size=8, sequence_length=128)
    by_shape = plan(
        llama,
        _one_device(),
        batch_size=8,
        input_shape={"token_ids": (128,), "padding_mask": (128,)},
    )
    # Token ids and padding mask (int32), then the embedding, two decoder
    # blocks and the final norm, (8, 128, 16) float32 each.
    expected = 2 * (8 * 128 * 4) + 4 * (8 * 128 * 16 * 4)
    assert by_length.devices[0].activations == expected
    assert by_shape.devices[0].activations == expected


def test_input_shape_and_sequence_length_mistakes_are_named():
    from tests.workers.plan_models import llama, mlp, unbuilt_mlp

    distribution = _one_device()
    with pytest.raises(TypeError, match="input_shape='4096'"):
        plan(unbuilt_mlp, distribution, input_shape="4096")
    with pytest.raises(ValueError, match=r"at least 1.*input_shape=\(0,\)"):
        plan(unbuilt_mlp, distribution, input_shape=(0,))
    with pytest.raises(ValueError, match="Building the model 'unbuilt'"):
        plan(unbuilt_mlp, distribution, input_shape={"x": (4,)})
    with pytest.raises(ValueError, match=r"'token_ids'.*\(None,\).*\(8, 2\)"):
        plan(
            llama, distribution, input_shape={"token_ids": (8, 2), "padding_mask": (8,)}
        )
    with pytest.raises(ValueError, match="one shape per input"):
        plan(llama, distribution, input_shape={"token_ids": (8,)})
    with pytest.raises(ValueError, match="one shape per input"):
        plan(llama, distribution, input_shape=(8,))
    with pytest.raises(ValueError, match="input_shape` or `sequence_length`, not both"):
        plan(llama, distribution, input_shape=(8,), sequence_length=8)
    with pytest.raises(ValueError, match=r"none of them has one.*\(None, 64\)"):
        plan(mlp, distribution, sequence_length=8)
    with pytest.raises(ValueError, match="sequence_length=0"):
        plan(llama, distribution, sequence_length=0)
    with pytest.raises(TypeError, match="sequence_length='8'"):
        plan(llama, distribution, sequence_length="8")
    # A model whose inputs have fixed shapes: input_shape must fit them.
    with pytest.raises(ValueError, match=r"does not fit.*\(64,\)"):
        plan(mlp, distribution, input_shape=(32,))
    # What the model's own code raises on the shape is named.
    with (
        warnings.catch_warnings(),  # Keras' own, about the failed build
        pytest.raises(ValueError, match="Building the model 'two_dense'.*failed"),
    ):
        warnings.simplefilter("ignore")
        plan(_TwoDense, distribution, input_shape={"a": (3,), "b": (4,)})
    # A graph that cannot run on the given shape: no estimate, and why.
    inputs = keras.Input((None,))
    model = keras.Model(inputs, keras.layers.Reshape((4, -1))(inputs))
    result = plan(model, distribution, input_shape=(15,), batch_size=2)
    assert result.devices[0].activations is None
    assert any("on inputs of shapes [(None, 15)] failed" in n for n in result.notes)


def test_a_mesh_larger_than_the_machine_is_planned_from_its_shape():
    from tests.workers.plan_models import mlp, mlp_clean_layout_map

    result = plan(mlp, kd.FSDP, mesh={"batch": 16, "model": 4}, device_memory=10**9)
    assert result.mesh == {"batch": 16, "model": 4}
    names = [device.device for device in result.devices]
    assert len(set(names)) == 64
    assert all(device.memory == 10**9 for device in result.devices)
    assert any("64 devices are placeholder names" in note for note in result.notes)
    kernel = next(row for row in result.rows if row.path == "mlp/up/kernel")
    assert kernel.bytes_per_device == kernel.total_bytes // 16  # FSDP along "batch"
    # A function of the mesh that builds a layout map on it.
    result = plan(
        mlp,
        lambda mesh: kd.ModelParallel(layout_map=mlp_clean_layout_map(mesh)),
        mesh={"batch": 2, "model": 4},
    )
    kernel = next(row for row in result.rows if row.path == "mlp/up/kernel")
    assert kernel.axes == (None, "model") and result.problems == []
    # Without enough devices of their own, placeholders report no memory.
    placeholders = any("placeholder" in note for note in result.notes)
    assert placeholders == (kd.get_device_count() < 8)


def test_mesh_mistakes_are_named():
    from tests.workers.plan_models import mlp

    with pytest.raises(TypeError, match=r"needs the mesh's shape as mesh="):
        plan(mlp, kd.FSDP)
    with pytest.raises(TypeError, match="a distribution has its own mesh"):
        plan(mlp, _one_device(), mesh={"batch": 1})
    for mesh in ({}, {"batch": 0}, ["batch"], {"batch": 2.0}):
        with pytest.raises(ValueError, match="`mesh` must be a dict of axis names"):
            plan(mlp, kd.FSDP, mesh=mesh)
    with pytest.raises(TypeError, match="must return a DataParallel"):
        plan(mlp, lambda mesh: "fsdp", mesh={"batch": 2})
    with pytest.raises(ValueError, match="on the mesh it is given"):
        plan(mlp, lambda mesh: _one_device(), mesh={"batch": 2})


def test_the_chart_has_one_bar_per_distinct_device_with_its_sizes_on_it():
    from keras_dist.planner.report import device_groups, plan_figure
    from tests.workers.plan_models import mlp

    def chart(memory):
        result = plan(
            mlp,
            kd.FSDP,
            mesh={"batch": 8},
            batch_size=8,
            optimizer="sgd",
            device_memory=memory,
        )
        return result, plan_figure(result).axes[0]

    # A 16 GiB budget against KiBs: written, not drawn, so the bar is seen.
    result, axes = chart(16 * 2**30)
    assert [label for label, _ in device_groups(result)] == [
        f"{result.devices[0].device} … {result.devices[-1].device} (8 devices)"
    ]
    # parameters, gradients, optimizer slots, activations
    assert [len(bars.patches) for bars in axes.containers] == [1, 1, 1, 1]
    tick_labels = [tick.get_text() for tick in axes.get_xticklabels()]
    assert tick_labels == [label for label, _ in device_groups(result)]
    height = sum(bars.patches[0].get_height() for bars in axes.containers)
    assert height / axes.get_ylim()[1] > 0.5  # the bar fills the chart
    texts = [text.get_text() for text in axes.texts]
    total = result.devices[0].total
    assert any(text.startswith(f"{total / 1024:.2f} KiB\n") for text in texts), texts
    assert any("device memory: 16.00 GiB" in text for text in texts), texts
    # The parameters' size is written inside their segment.
    parameters = [t.get_text() for t in axes.texts if t.get_text().endswith("KiB")]
    assert f"{result.devices[0].parameters / 1024:.2f} KiB" in parameters
    # A budget within reach of the bar is drawn, at its height.
    result, axes = chart(total * 2)
    (line,) = axes.collections
    assert line.get_segments()[0][0][1] == pytest.approx(2 * total / 1024)
    assert not any("device memory:" in text.get_text() for text in axes.texts)


# -- issue 25: KerasHub's layouts and the swapped-axes check -----------------------


def _placeholder_mesh(shape, axes):
    """A mesh of placeholder devices: the planner never touches them."""
    names = [f"cpu:{index}" for index in range(int(np.prod(shape)))]
    return kd.DeviceMesh(shape, axes, names)


@pytest.mark.parametrize("kind", ["gemma", "llama", "qwen", "qwen_moe", "qwen3_moe"])
def test_keras_hub_layouts_plan_clean_through_for_keras_hub(kind):
    pytest.importorskip("keras_hub")
    from tests.workers.plan_models import keras_hub_backbone

    backbone = keras_hub_backbone(kind)
    mesh = _placeholder_mesh((2, 4), ["batch", "model"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its repairs warn (tests/test_layouts.py)
        layout_map = kd.layouts.for_keras_hub(backbone, mesh)
    for distribution in (
        kd.FSDP(mesh, layout_map=layout_map),
        kd.ModelParallel(layout_map=layout_map),
    ):
        result = plan(backbone, distribution, batch_size=8)
        assert result.problems == [], [p.message for p in result.problems]


def test_a_genuinely_swapped_layout_is_still_reported():
    """KerasHub's own Llama map (keras-hub#2827): its query/key/value kernels
    are (hidden, heads, head_dim), and Gemma's (model, data, None) copied onto
    them puts the model axis on the width (16) and the data axis on the
    heads. Gemma's own kernels, (heads, hidden, head_dim), take it well; the
    same kernels with the two axes exchanged by hand are reported."""
    keras_hub = pytest.importorskip("keras_hub")
    from tests.workers.plan_models import keras_hub_backbone

    mesh = _placeholder_mesh((2, 4), ["batch", "model"])
    attention = [
        f"transformer_layer_{i}/self_attention/{name}/kernel"
        for i in (0, 1)
        for name in ("query", "key", "value")
    ]
    llama = keras_hub_backbone("llama")
    own_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    result = plan(llama, kd.ModelParallel(layout_map=own_map))
    assert _kinds(result) == ["swapped-axes"]
    assert _paths(result, "swapped-axes") == sorted(attention)
    assert "(size 16)" in result.problems[0].message
    assert "for_keras_hub repairs" in result.problems[0].message
    # Gemma: clean with KerasHub's layout, reported when swapped by hand.
    gemma = keras_hub_backbone("gemma")
    mesh = _placeholder_mesh((2, 2), ["batch", "model"])  # 2 key/value heads
    gemma_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    assert _kinds(plan(gemma, kd.ModelParallel(layout_map=gemma_map))) == []
    swapped = kd.LayoutMap(mesh)
    for key in gemma_map:
        axes = tuple(gemma_map[key].axes)
        if "query|key|value" in key:
            axes = (axes[1], axes[0], axes[2])  # ("batch", "model", None)
        swapped[key] = axes
    result = plan(gemma, kd.ModelParallel(layout_map=swapped))
    assert _kinds(result) == ["swapped-axes"]
    assert _paths(result, "swapped-axes") == sorted(
        f"decoder_block_{i}/attention/{name}/kernel"
        for i in (0, 1)
        for name in ("query", "key", "value")
    )


def test_gradients_are_counted_and_the_headline_says_by_how_much():
    from tests.workers.plan_models import mlp

    def planned(memory):
        return plan(
            mlp,
            kd.DataParallel,
            mesh={"batch": 2},
            optimizer="adam",
            device_memory=memory,
        )

    result = planned(None)
    device = result.devices[0]
    trainable = sum(r.bytes_per_device for r in result.rows if r.role == "trainable")
    # Weights, one gradient each, Adam's two moments (and its step counters).
    assert device.gradients == trainable == device.parameters
    assert device.total == device.parameters + device.gradients + device.optimizer_slots
    assert device.optimizer_slots >= 2 * trainable
    assert result.fits is None and "Fits: unknown" in str(result)
    short = planned(device.total - 1000)
    assert short.fits is False
    assert str(short).startswith("Does not fit:") and "short (static estimate)" in str(
        short
    )
    assert "gradients" in next(p.message for p in short.problems)
    roomy = planned(device.total + 2**20)
    assert roomy.fits is True and str(roomy).startswith("Fits:")


def _attention_decoder(length: int = 64, layout_key: bool = False):
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(512, 64, name="embed")(tokens)
    attended = keras.layers.MultiHeadAttention(4, 16, name="attention")(
        hidden, hidden, use_causal_mask=True
    )
    outputs = keras.layers.Dense(512, name="logits")(attended)
    model = keras.Model(tokens, outputs, name="decoder")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.backend("jax")
def test_fsdp_with_a_sequence_axis_is_planned_on_both_axes_as_it_lays_out():
    model = _attention_decoder()
    mesh = _mesh((2, 4), ["batch", "seq"])
    distribution = kd.FSDP(mesh, min_size=16, sequence_axis="seq")
    result = plan(model, distribution, batch_size=8)
    rows = {row.path: row for row in result.rows}
    for variable in model.trainable_variables:
        laid_out = tuple(distribution.layout_for_variable(variable).axes)
        assert rows[variable.path].axes == laid_out
    embeddings = rows["embed/embeddings"]
    assert embeddings.axes == ("batch", "seq")
    assert embeddings.bytes_per_device == 512 * 64 * 4 // 8
    # A LayoutMap key with more axes than the variable has dimensions is
    # planned with FSDP's own splits, both of them.
    layout_map = kd.LayoutMap(mesh)
    layout_map["logits/kernel"] = ("batch", None, None)
    mapped = plan(
        model,
        kd.FSDP(mesh, min_size=16, layout_map=layout_map, sequence_axis="seq"),
        batch_size=8,
    )
    logits = next(row for row in mapped.rows if row.path == "logits/kernel")
    assert "too-many-axes" in _kinds(mapped)
    assert sorted(filter(None, logits.axes)) == ["batch", "seq"]
    assert logits.bytes_per_device == 64 * 512 * 4 // 8


@pytest.mark.backend("jax")
def test_activations_with_a_sequence_axis_are_split_along_it():
    model = _attention_decoder()
    batch_only = plan(model, kd.DataParallel(_mesh((8,), ["batch"])), batch_size=8)
    split = plan(
        model,
        kd.DataParallel(_mesh((2, 4), ["batch", "seq"]), sequence_axis="seq"),
        batch_size=8,
    )
    # One eighth of the tokens on each device either way.
    assert split.devices[0].activations == batch_only.devices[0].activations
    assert split.devices[0].activations > 0
    assert any("sequence_axis='seq'" in note for note in split.notes)
    assert not any("sequence_axis=" in note for note in batch_only.notes)
