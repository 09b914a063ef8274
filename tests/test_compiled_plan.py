"""`keras_dist.plan(..., topology=...)`: fit's own steps compiled for a
topology, on abstract values.

`cpu:8` runs in every JAX run (8 simulated devices). The TPU topologies need
`libtpu`: `tests/run_tpu_topology.sh` runs this file again in a virtual
environment that has it; without it those tests are skipped and the error
that names the missing library is tested instead.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.backends import get_adapter
from keras_dist.common import accelerators
from keras_dist.planner.compiled import UntrainableModelError
from keras_dist.planner.topology import parse_topology
from tests.test_docs_code_blocks import OUTPUTS, PYTHON_BLOCKS, output_problems
from tests.workers import plan_models

BACKEND = keras.backend.backend()
jax_only = pytest.mark.backend("jax")
REPO = pathlib.Path(__file__).resolve().parents[1]


def _has_libtpu() -> bool:
    try:
        importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_libtpu = pytest.mark.skipif(
    not _has_libtpu(), reason="needs libtpu (tests/run_tpu_topology.sh)"
)

WIDTH = 512


def mlp(width: int = WIDTH, dtype_policy: str | None = None, compile_it: bool = True):
    def build():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(width, activation="relu", dtype=dtype_policy),
                keras.layers.Dropout(0.1),
                keras.layers.Dense(width, activation="relu", dtype=dtype_policy),
                keras.layers.Dense(10, dtype=dtype_policy),
            ],
            name="mlp",
        )
        if compile_it:
            model.compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        return model

    return build


def _parameters(width: int = WIDTH) -> int:
    return 64 * width + width + width * width + width + width * 10 + 10


# -- names, read before anything runs -------------------------------------------
@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "name, libtpu_name, chips",
    [
        ("v5e:2x2", "v5e:2x2", 4),
        ("v5e-256", "v5e:16x16", 256),
        ("v5litepod-16", "v5e:4x4", 16),
        ("v5p-128", "v5p:4x4x4", 64),
        ("v5p:4x4x8", "v5p:4x4x8", 128),
        ("v4-8", "v4:2x2x1", 4),
        ("v6e-8", "v6e:2x4", 8),
        ("cpu:8", "", 8),
    ],
)
def test_topology_names(name, libtpu_name, chips):
    topology = parse_topology(name)
    assert (topology.libtpu_name, topology.chips) == (libtpu_name, chips)


@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "name, words",
    [
        ("v9x:2x2", "Unknown topology 'v9x:2x2'"),
        ("tpu", "Unknown topology 'tpu'"),
        ("v5e:2x2x2", "2-D grid"),
        ("v5p-7", "counts TensorCores"),
        ("v5e-12", "N in [1, 4, 8"),
    ],
)
def test_unknown_topologies_are_refused_with_what_is_known(name, words):
    with pytest.raises(ValueError, match="topology") as raised:
        parse_topology(name)
    assert words in str(raised.value)


@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "name, words",
    [
        (
            "v5e:3x3",
            "The v5e slices: 1x1, 2x2, 2x4 (one host), 4x4, 4x8, 8x8, 8x16, 16x16 "
            "(several hosts); by Cloud's names v5e-N, N the chips: 1, 4, 8, 16",
        ),
        ("v6e:1x3", "The v6e slices: 1x1, 2x2, 2x4 (one host)"),
        (
            "v5p:3x2x2",
            "The v5p slices: 2x2x1 (one host), 2x2x2, 2x2x4, 2x4x4, 4x4x4, "
            "4x4x8, 4x8x8, 8x8x8, 8x8x16, 8x16x16, 16x16x16 (several hosts); by "
            "Cloud's names v5p-N, N the TensorCores, two a chip: 8, 16",
        ),
    ],
)
def test_a_grid_libtpu_cannot_lay_out_says_which_slices_exist(name, words):
    """Checked against libtpu 0.0.42: a grid size above 1 along either of the
    first two axes must be even (2x2 chips a host); 3x3 is refused."""
    with pytest.raises(ValueError, match="first two sizes is 1 or even") as raised:
        parse_topology(name)
    assert words in str(raised.value)
    assert f"Received: topology={name!r}" in str(raised.value)
    parse_topology(name.replace("3", "2"))  # the same grid, evened: accepted


@jax_only
def test_a_topology_libtpu_refuses_is_said_with_the_slices_that_exist(monkeypatch):
    def refuse(self, platform, name, count, num_slices):
        raise ValueError(f"libtpu refused the topology {name!r}: not divisible")

    monkeypatch.setattr(type(get_adapter()), "topology_devices", refuse)
    with pytest.raises(ValueError, match="libtpu refused") as raised:
        kd.plan(mlp(), kd.DataParallel, topology="v5e:2x2", batch_size=8)
    assert "The v5e slices: 1x1, 2x2, 2x4 (one host)" in str(raised.value)


@pytest.mark.backend_neutral
def test_bad_slice_counts_and_types():
    with pytest.raises(ValueError, match="num_slices` must be at least 1"):
        parse_topology("v5e:2x2", 0)
    with pytest.raises(TypeError, match="topology` must be a string"):
        parse_topology(8)
    with pytest.raises(ValueError, match="CPU topologies have one slice"):
        parse_topology("cpu:8", 2)


@jax_only
def test_a_mesh_of_another_size_is_refused_before_compiling():
    with pytest.raises(ValueError, match=r"mesh \{'batch': 3\} has 3 devices"):
        kd.plan(mlp(), kd.FSDP, topology="cpu:8", mesh={"batch": 3}, batch_size=8)
    with pytest.raises(ValueError, match="4 chips"):
        kd.plan(mlp(), kd.FSDP, topology="v5e:2x2", mesh={"batch": 8}, batch_size=8)


@jax_only
def test_an_uncompiled_model_is_refused_before_compiling():
    with pytest.raises(UntrainableModelError) as raised:
        kd.plan(mlp(compile_it=False), kd.DataParallel, topology="cpu:8", batch_size=8)
    # The library speaks Python (the command says it as flags: test_cli.py).
    message = str(raised.value)
    assert "call model.compile(optimizer=..., loss=...) in the model function" in (
        message
    )
    assert "steps=('predict',)" in message and "--" not in message
    assert raised.value.missing == "compile"
    assert raised.value.steps == ["train", "test"]
    with pytest.raises(
        UntrainableModelError, match=r"Give model.compile\(loss="
    ) as raised:
        kd.plan(
            plan_models.mlp_without_loss,
            kd.DataParallel,
            topology="cpu:8",
            batch_size=8,
            steps=("train",),
        )
    assert raised.value.missing == "loss"
    # Prediction alone needs no loss.
    result = kd.plan(
        mlp(compile_it=False),
        kd.DataParallel,
        topology="cpu:8",
        batch_size=8,
        steps=("predict",),
    )
    assert list(result.compiled.steps) == ["predict"]


@jax_only
def test_a_batch_size_is_needed_and_a_distribution_object_is_refused():
    with pytest.raises(ValueError, match="needs `batch_size`"):
        kd.plan(mlp(), kd.FSDP, topology="cpu:8")
    with pytest.raises(TypeError, match="function of the DeviceMesh"):
        kd.plan(mlp(), kd.DataParallel(), topology="cpu:8", batch_size=8)
    with pytest.raises(ValueError, match="`steps` must name some of"):
        kd.plan(mlp(), kd.FSDP, topology="cpu:8", batch_size=8, steps=("fit",))


@jax_only
@pytest.mark.skipif(_has_libtpu(), reason="libtpu is installed here")
def test_a_tpu_topology_without_libtpu_names_the_extra():
    with pytest.raises(RuntimeError, match=r"needs libtpu.*keras-dist\[tpu\]"):
        kd.plan(mlp(), kd.FSDP, topology="v5e:2x2", batch_size=8)


@pytest.mark.backend("torch", "tensorflow")
def test_other_backends_keep_the_static_plan_and_say_so():
    with pytest.raises(NotImplementedError, match="needs the JAX backend"):
        kd.plan(mlp(), kd.FSDP, topology="cpu:2", batch_size=8)
    result = kd.plan(mlp(), kd.FSDP, mesh={"batch": 2}, batch_size=8)
    assert result.compiled is None
    assert any("This plan is the static one" in note for note in result.notes)


# -- cpu:N: the plan's program is the real fit's -------------------------------------
def _fit_step_function(model):
    """The jitted train step Keras' own `fit` made for `model` (keras_dist
    keeps the run's compiled functions for the next run)."""
    function = model.__dict__["_keras_dist_compiled"]["compiled"]["train_function"]
    for _ in range(4):
        found = {
            name: value
            for name, value in inspect.getclosurevars(function).nonlocals.items()
            if hasattr(value, "lower")
        }
        if found:
            return next(iter(found.values()))
        function = next(
            value
            for value in inspect.getclosurevars(function).nonlocals.values()
            if callable(value)
        )
    raise AssertionError("no jitted step in model.train_function")


@jax_only
@pytest.mark.parametrize("policy", ["DataParallel", "FSDP"])
def test_cpu_plan_compiles_the_program_a_real_fit_runs(policy):
    make = getattr(kd, policy)
    result = kd.plan(mlp(), make, topology="cpu:8", batch_size=64)
    compiled = result.compiled
    train = compiled.steps["train"]
    assert train.error is None and compiled.devices == 8
    # The same model trained for real on the same 8 devices.
    model = mlp()()
    distribution = result.made_distribution
    x = np.random.rand(64, 64).astype("float32")
    y = np.random.randint(0, 10, 64)
    model.fit(
        x,
        y,
        batch_size=64,
        epochs=1,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    step = _fit_step_function(model)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    keras.distribution.set_distribution(distribution)
    try:
        layout = distribution.get_data_layout((64, 64)).backend_layout
        import jax  # noqa: PLC0415

        batch = (
            jax.device_put(x, layout),
            jax.device_put(
                y.astype("int64"), distribution.get_data_layout((64,)).backend_layout
            ),
        )
        real = step.lower(state, batch).compile()
    finally:
        keras.distribution.set_distribution(None)
    memory = real.memory_analysis()
    assert train.argument_bytes == memory.argument_size_in_bytes
    assert train.temp_bytes == memory.temp_size_in_bytes
    assert train.flops == pytest.approx(real.cost_analysis()["flops"], rel=1e-6)
    # Replicated weights, Adam's two moments: 3 copies of the parameters
    # per device; FSDP splits them 8 ways.
    whole = 3 * 4 * _parameters()
    expected = whole if policy == "DataParallel" else whole / 8
    assert train.argument_bytes == pytest.approx(expected, rel=0.05)
    gathered = train.collective_bytes["all-gather"]
    reduced = (
        train.collective_bytes["all-reduce"] + train.collective_bytes["reduce-scatter"]
    )
    assert reduced > 0
    if policy == "DataParallel":
        assert gathered == 0
        # The gradients are summed: at least the parameters' bytes.
        assert reduced >= 4 * _parameters()


@jax_only
def test_every_step_is_compiled_and_the_plan_prints_whose_figures_they_are():
    result = kd.plan(mlp(), kd.FSDP, topology="cpu:8", batch_size=64)
    assert set(result.compiled.steps) == {"train", "test", "predict"}
    for step in result.compiled.steps.values():
        assert step.peak_bytes and step.flops > 0
    train, test = result.compiled.steps["train"], result.compiled.steps["test"]
    assert train.flops > 2 * test.flops  # the backward pass
    text = str(result)
    assert "Compiled for cpu:8" in text and "XLA's" in text
    assert result.fits is None  # a CPU's memory is unknown
    sized = kd.plan(
        mlp(), kd.FSDP, topology="cpu:8", batch_size=64, device_memory=2**16
    )
    assert sized.fits is False and sized.compiled.margin_bytes < 0
    assert "Does not fit" in str(sized)
    assert result.to_dict()["compiled"]["steps"]["train"]["flops"] == train.flops


# -- TPU topologies (libtpu) ------------------------------------------------------
@jax_only
@needs_libtpu
def test_tpu_topology_plan_reads_xla_memory_flops_and_collectives():
    batch = 256
    plain = kd.plan(mlp(), kd.DataParallel, topology="v5e:2x2", batch_size=batch)
    split = kd.plan(mlp(), kd.FSDP, topology="v5e:2x2", batch_size=batch)
    for result in (plain, split):
        assert result.compiled.device_kind == "TPU v5 lite"
        assert result.compiled.devices == 4
        # What JAX lets a program allocate on a v5e chip, not the data sheet's 16.
        assert result.fits is True and result.compiled.memory == int(15.75 * 2**30)
        assert any("15.75 GiB usable" in note for note in result.compiled.notes)
    weights_and_moments = 3 * 4 * _parameters()
    plain_train = plain.compiled.steps["train"]
    split_train = split.compiled.steps["train"]
    assert plain_train.argument_bytes == pytest.approx(weights_and_moments, rel=0.05)
    assert split_train.argument_bytes == pytest.approx(
        weights_and_moments / 4,
        rel=0.1,  # biases replicated, tiles padded
    )
    # 6 flops per parameter and sample (forward 2, backward 4), a quarter of
    # the batch on each device.
    # (On a TPU, Dropout's random bits add their own flops.)
    assert plain_train.flops == pytest.approx(6 * _parameters() * batch / 4, rel=0.15)
    assert plain_train.collective_bytes["all-reduce"] >= 4 * _parameters()
    assert plain_train.step_seconds > 0 and 0 < plain_train.mfu <= 1
    assert set(plain_train.seconds) == {
        "compute",
        "memory",
        "host",
        "interconnect",
        "network",
    }
    # Nothing offloaded: no host bytes, no host time; the memory term counts
    # the arguments read and the outputs written, less than XLA's unfused
    # bytes accessed.
    assert plain_train.host_peak_bytes == 0 and plain_train.seconds["host"] == 0
    assert plain_train.host_to_device_bytes == plain_train.device_to_host_bytes == 0
    assert plain_train.device_traffic_bytes >= plain_train.argument_bytes
    assert plain_train.device_traffic_bytes < plain_train.bytes_accessed


@jax_only
@needs_libtpu
def test_tpu_plan_of_a_model_too_large_does_not_fit_with_the_margin_said():
    result = kd.plan(
        mlp(width=40960), kd.DataParallel, topology="v5e:2x2", batch_size=64
    )
    assert result.fits is False
    assert result.compiled.margin_bytes < 0 or any(
        step.error for step in result.compiled.steps.values()
    )
    assert "Does not fit" in str(result)


def _named_mlp(width: int = WIDTH):
    def build():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(width, activation="relu", name="d1"),
                keras.layers.Dense(width, activation="relu", name="d2"),
                keras.layers.Dense(16, name="d3"),
            ],
            name="named_mlp",
        )
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return build


def _tensor_parallel(build):
    made = build()

    def distribution(mesh):
        layout_map = kd.layouts.tensor_parallel(made, mesh)
        return kd.ModelParallel(mesh, layout_map=layout_map, batch_dim_name="batch")

    return distribution


@jax_only
@needs_libtpu
def test_multi_slice_plan_counts_the_gradients_crossing_slices_on_the_network():
    """XLA hands the cross-slice all-reduce of the gradients to the megascale
    runtime (send/recv pairs): each chip moves at least its shard of the
    gradients across slices, and the network term counts it."""
    result = kd.plan(
        _named_mlp(),
        kd.DataParallel,
        topology="v5e:2x2",
        num_slices=2,
        batch_size=64,
        steps=("train",),
    )
    compiled = result.compiled
    assert compiled.devices == 8 and compiled.num_slices == 2
    assert compiled.slice_axis == "batch"
    assert "2 slices (mesh axis 'batch' spans them)" in str(result)
    train = compiled.steps["train"]
    gradient_bytes = sum(
        row.total_bytes for row in result.rows if row.role == "trainable"
    )
    chips_per_slice = 4
    shard = gradient_bytes / chips_per_slice
    assert train.collective_bytes["cross-slice"] >= shard
    assert train.collective_counts["cross-slice"] >= 1
    network = accelerators.kind_of("TPU v5 lite").network_bandwidth
    # A ring all-reduce across 2 slices: each chip sends its shard once.
    assert train.seconds["network"] >= shard / network
    assert train.step_seconds >= train.seconds["network"]


@jax_only
@needs_libtpu
def test_multi_slice_plan_lays_the_batch_axis_across_slices_not_the_model_axis():
    build = _named_mlp()
    result = kd.plan(
        build,
        _tensor_parallel(build),
        topology="v5e:2x2",
        num_slices=2,
        mesh={"model": 2, "batch": 4},
        batch_size=64,
        steps=("train",),
    )
    assert result.compiled.slice_axis == "batch"
    assert result.compiled.steps["train"].collective_bytes["cross-slice"] > 0


@jax_only
@needs_libtpu
def test_multi_slice_plan_warns_when_only_a_model_axis_can_span_slices():
    build = _named_mlp()
    with pytest.warns(UserWarning, match="mesh axis 'model' spans them") as caught:
        result = kd.plan(
            build,
            _tensor_parallel(build),
            topology="v5e:2x2",
            num_slices=2,
            mesh={"batch": 1, "model": 8},
            batch_size=64,
            steps=("train",),
        )
    assert "data-center network" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert result.compiled.slice_axis == "model"


@jax_only
def test_collectives_count_megascale_sends_and_groups_wider_than_a_slice():
    from keras_dist.backends.jax.compiled_plan import collectives  # noqa: PLC0415

    hlo = "\n".join(
        [
            "%send = (f32[256]{0}, u32[], token[]) send(%a, %t), channel_id=2, "
            '_xla_host_transfer_rendezvous="all-reduce.1_0",'
            '_xla_megascale_transfer_type="ALL_REDUCE"',
            "%recv = (f32[256]{0}, u32[], token[]) recv(%t), channel_id=1, "
            '_xla_host_transfer_rendezvous="all-reduce.1_0",'
            '_xla_megascale_transfer_type="ALL_REDUCE"',
            "%all-reduce.1 = f32[64]{0} all-reduce(%b), channel_id=3, "
            "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
            "%all-reduce.2 = f32[32]{0} all-reduce(%c), channel_id=4, "
            "replica_groups={{0,1}}, to_apply=%add",
        ]
    )
    moved, counts = collectives(hlo, slice_devices=4)
    # The send's payload (its recv not again), and the 8-device all-reduce
    # on slices of 4 devices.
    assert moved["cross-slice"] == 256 * 4 + 64 * 4
    assert counts["cross-slice"] == 2
    assert moved["all-reduce"] == (64 + 32) * 4
    moved, counts = collectives(hlo)
    assert moved["cross-slice"] == 256 * 4 and counts["cross-slice"] == 1
    # Across 4 slices a ring sends 2 x 3/4 of an all-reduce's buffer, and
    # its shard to each of the 3 other slices for an all-gather.
    gather = (
        "%send.1 = (f32[64]{0}, u32[], token[]) send(%g, %t), channel_id=5, "
        '_xla_host_transfer_rendezvous="all-gather.2_0",'
        '_xla_megascale_transfer_type="ALL_GATHER"'
    )
    moved, counts = collectives(hlo + "\n" + gather, num_slices=4)
    assert moved["cross-slice"] == 1.5 * 256 * 4 + 3 * 64 * 4
    assert counts["cross-slice"] == 2


@jax_only
def test_cli_compiles_for_a_topology_and_says_when_it_does_not_fit():
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import pathlib  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parents[1]
    environment = {**os.environ, "KERAS_DIST_CPU_DEVICES": "8", "KERAS_BACKEND": "jax"}
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "plan",
        "tests.workers.plan_models:compiled_mlp",
        "--topology",
        "cpu:8",
        "--mesh",
        "4,2",
        "--axes",
        "batch,model",
        "--fsdp",
        "--batch-size",
        "32",
        "--steps",
        "train",
        "--json",
    ]
    fits = subprocess.run(
        command + ["--device-memory", "1GB"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=environment,
    )
    assert fits.returncode == 0, fits.stderr[-2000:]
    report = json.loads(fits.stdout.strip().splitlines()[-1])
    assert report["fits"] is True
    train = report["compiled"]["steps"]["train"]
    assert train["peak_bytes"] > 0 and report["compiled"]["devices"] == 8
    short = subprocess.run(
        command + ["--device-memory", "10KB"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=environment,
    )
    assert short.returncode == 1
    assert json.loads(short.stdout.strip().splitlines()[-1])["fits"] is False
    unknown = subprocess.run(
        command[:5] + ["--topology", "v9:2x2", "--batch-size", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=environment,
    )
    assert unknown.returncode == 1 and "Unknown topology 'v9:2x2'" in unknown.stderr


@jax_only
@needs_libtpu
def test_keras_traces_the_step_as_on_the_topologys_platform():
    """Keras picks some ops by the default device's platform (the TPU
    splash-attention kernel): a plan for a TPU slice traced on a CPU host
    must see the TPU, and only while it traces."""
    import jax  # noqa: PLC0415

    from keras_dist.backends.jax import keras_internals  # noqa: PLC0415
    from keras_dist.backends.jax.compiled_plan import topology_devices  # noqa: PLC0415

    devices = topology_devices("tpu", "v5e:2x2", 4, 1)
    with keras_internals.platform_seen_by_keras(devices):
        assert jax.devices()[0].platform == "tpu"
        assert jax.default_backend() == "tpu"
        assert jax.devices("cpu")[0].platform == "cpu"
    assert jax.devices()[0].platform == "cpu" and jax.default_backend() == "cpu"

    def attention():
        tokens = keras.Input((128, 64))
        attended = keras.layers.MultiHeadAttention(4, 16)(tokens, tokens)
        model = keras.Model(tokens, keras.layers.Dense(10)(attended))
        model.compile(optimizer="adam", loss="mse")
        return model

    # One chip: Keras' splash-attention kernel, as on the chip itself.
    one = kd.plan(attention, kd.DataParallel, topology="v5e:1x1", batch_size=8)
    assert one.compiled.steps["train"].error is None and one.fits is True
    # Four chips: Keras 3.15 calls the kernel without a shard_map, which XLA
    # cannot partition; the plan says so in XLA's words instead of crashing.
    four = kd.plan(attention, kd.DataParallel, topology="v5e:2x2", batch_size=8)
    error = four.compiled.steps["train"].error
    assert (
        error is None or "Mosaic kernels cannot be automatically partitioned" in error
    )
    if error:
        assert four.fits is not True and "XLA refused the train step" in str(four)


# -- host memory and the roofline -------------------------------------------------
def _offloaded_step(devices: list):
    """A step whose moment lives in pinned_host: brought in, updated, sent
    back (as `offload="optimizer"` does for each variable)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    device = jax.sharding.SingleDeviceSharding(devices[0], memory_kind="device")
    host = jax.sharding.SingleDeviceSharding(devices[0], memory_kind="pinned_host")

    def step(weight, moment):
        moment = jax.device_put(moment, device) * 0.9 + 0.1
        return weight - moment, jax.device_put(moment, host)

    arguments = (
        jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=device),
        jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=host),
    )
    jitted = jax.jit(step, out_shardings=(device, host), donate_argnums=(0, 1))
    return jitted.lower(*arguments).compile()


@jax_only
def test_host_transfers_are_read_from_the_compiled_program():
    import jax  # noqa: PLC0415

    from keras_dist.backends.jax import compiled_plan  # noqa: PLC0415

    # CPU: XLA writes the memory spaces on the signature alone: the moment is
    # read once and written once.
    compiled = _offloaded_step(jax.devices("cpu"))
    moment = 256 * 256 * 4
    assert compiled_plan.host_transfers(compiled.as_text()) == (moment, moment)
    plain = jax.jit(lambda x: x * 2).lower(np.ones(8, "float32")).compile()
    assert compiled_plan.host_transfers(plain.as_text()) == (0, 0)
    # An output that is its argument unchanged is written by nobody.
    text = (
        "ENTRY %main (a: f32[4], b: f32[8]) -> (f32[4], f32[8]) {\n"
        "  %a = f32[4]{0} parameter(0)\n"
        "  %b = f32[8]{0} parameter(1)\n"
        "  %c = f32[4]{0} add(%a, %a)\n"
        "  ROOT %t = (f32[4]{0}, f32[8]{0}) tuple(%c, %b)\n"
        "}\n"
    )
    assert compiled_plan.passed_through_bytes(text) == 32


@jax_only
@needs_libtpu
def test_tpu_host_transfers_are_each_copy_between_the_memories():
    from keras_dist.backends.jax import compiled_plan  # noqa: PLC0415

    devices = compiled_plan.topology_devices("tpu", "v5e:1x1", 1, 1)
    compiled = _offloaded_step(devices)
    moment = 256 * 256 * 4
    assert compiled_plan.host_transfers(compiled.as_text()) == (moment, moment)
    memory = compiled.memory_analysis()
    assert memory.host_argument_size_in_bytes == moment


@pytest.mark.backend_neutral
def test_the_roofline_is_a_lower_bound_with_a_host_term():
    from keras_dist.common.accelerators import kind_of  # noqa: PLC0415
    from keras_dist.planner.compiled import _projected  # noqa: PLC0415

    v5e = kind_of("TPU v5 lite")
    figures = {
        "kind": "train",
        "compile_seconds": 1.0,
        "flops": 197e9,  # 1 ms at the bf16 peak
        "bytes_accessed": 8.19e9,  # unfused: 10 ms, not a bound
        "device_traffic_bytes": int(1.638e9),  # 2 ms
        "host_to_device_bytes": int(45e6),  # 3 ms at 15 GB/s
        "device_to_host_bytes": int(30e6),  # overlaps the other way
        "collective_bytes": {},
    }
    step = _projected(figures, v5e, "bfloat16", 1)
    assert step.seconds["compute"] == pytest.approx(1e-3)
    assert step.seconds["memory"] == pytest.approx(2e-3)
    assert step.seconds["host"] == pytest.approx(3e-3)
    assert step.step_seconds == pytest.approx(3e-3)
    assert step.mfu == pytest.approx(1 / 3)
    # A chip without a host bandwidth in the table: the term is not known.
    v4 = kind_of("TPU v4")
    assert _projected(figures, v4, "bfloat16", 1).seconds["host"] is None


@jax_only
def test_an_offloaded_plan_reports_host_bytes_and_traffic():
    def offloaded(mesh):
        return kd.FSDP(mesh, offload="optimizer")

    result = kd.plan(mlp(), offloaded, topology="cpu:8", batch_size=64)
    plain = kd.plan(mlp(), kd.FSDP, topology="cpu:8", batch_size=64)
    moments = 2 * 4 * _parameters() / 8  # Adam's two, an eighth a device
    compiled = result.compiled
    assert compiled.host_traffic_bytes >= 2 * moments * 0.95  # in and out
    assert plain.compiled.host_traffic_bytes == 0
    text = str(result)
    assert "host traffic" in text and " in, " in text
    assert result.to_dict()["compiled"]["host_traffic_bytes"] > 0


@jax_only
@needs_libtpu
def test_tpu_offloaded_plan_reports_host_bytes_and_the_host_term():
    def offloaded(mesh):
        return kd.DataParallel(mesh, offload="optimizer")

    result = kd.plan(mlp(), offloaded, topology="v5e:1x1", batch_size=64)
    train = result.compiled.steps["train"]
    moments = 2 * 4 * _parameters()  # Adam's two, float32, one chip
    assert train.host_argument_bytes >= moments
    assert result.compiled.host_peak_bytes >= moments
    assert train.host_to_device_bytes >= moments
    assert train.device_to_host_bytes >= moments
    host = train.seconds["host"]
    assert host == pytest.approx(train.host_to_device_bytes / 15e9)
    assert train.step_seconds >= host > 0
    assert "host traffic" in str(result)


@jax_only
def test_a_libtpu_of_another_version_is_named_with_the_pin(monkeypatch):
    from keras_dist.backends.jax import compiled_plan  # noqa: PLC0415

    real = importlib.metadata.version

    def version(name):
        return "0.0.1" if name == "libtpu" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    problem = compiled_plan.libtpu_problem()
    assert problem is not None
    assert "libtpu 0.0.1 is installed, but jax" in problem
    assert "keras-dist[tpu]" in problem
    with pytest.raises(RuntimeError, match="libtpu 0.0.1 is installed"):
        kd.plan(mlp(), kd.FSDP, topology="v5e:2x2", batch_size=8)


def _attention_decoder(length: int):
    def build():
        tokens = keras.Input((length,), dtype="int32")
        hidden = keras.layers.Embedding(256, 64)(tokens)
        attended = keras.layers.MultiHeadAttention(4, 16)(
            hidden, hidden, use_causal_mask=True
        )
        hidden = keras.layers.LayerNormalization()(hidden + attended)
        model = keras.Model(tokens, keras.layers.Dense(256)(hidden), name="decoder")
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    return build


@jax_only
@needs_libtpu
def test_tpu_plan_with_a_sequence_axis_holds_less_than_fsdp_on_the_batch():
    """One sequence of 512 tokens on a v5e-8: split over the 8 chips
    (`sequence_axis`), each holds its rows of the attention scores; FSDP on
    the batch alone pads the batch to 8 and one chip holds them all. The
    keys and values are all-gathered along the sequence axis."""
    length = 512
    on_sequence = kd.plan(
        _attention_decoder(length),
        lambda mesh: kd.FSDP(mesh, min_size=16, sequence_axis="seq"),
        mesh={"batch": 1, "seq": 8},
        topology="v5e-8",
        batch_size=1,
        steps=("train",),
    )
    on_batch = kd.plan(
        _attention_decoder(length),
        lambda mesh: kd.FSDP(mesh, min_size=16),
        topology="v5e-8",
        batch_size=1,
        steps=("train",),
    )
    split = on_sequence.compiled.steps["train"]
    whole = on_batch.compiled.steps["train"]
    assert split.error is None and whole.error is None
    assert on_sequence.compiled.devices == 8
    assert split.peak_bytes < 0.75 * whole.peak_bytes, (
        split.peak_bytes,
        whole.peak_bytes,
    )
    # Without FSDP's weight gathers, the all-gathers are attention's: the
    # whole sequence of its keys and values ([1, 512, 4 heads, 16]) on every
    # chip, or of the hidden state ([1, 512, 64]) XLA projects them from.
    replicated = kd.plan(
        _attention_decoder(length),
        lambda mesh: kd.DataParallel(mesh, sequence_axis="seq"),
        mesh={"batch": 1, "seq": 8},
        topology="v5e-8",
        batch_size=1,
        steps=("train",),
    ).compiled.steps["train"]
    assert replicated.error is None
    assert replicated.collective_counts["all-gather"] >= 2
    assert replicated.collective_bytes["all-gather"] >= length * 64 * 4


@jax_only
@needs_libtpu
def test_multi_slice_plan_warns_when_a_sequence_axis_spans_slices():
    """A mesh whose batch axis the slices do not divide puts the sequence
    axis across them: the warning names it and what crosses the network
    with it (attention's keys and values)."""
    with pytest.warns(UserWarning, match="mesh axis 'seq' spans them") as caught:
        result = kd.plan(
            _attention_decoder(256),
            lambda mesh: kd.DataParallel(mesh, sequence_axis="seq"),
            topology="v5e:2x2",
            num_slices=2,
            mesh={"batch": 1, "seq": 8},
            batch_size=1,
            steps=("train",),
        )
    message = str(caught[0].message)
    assert "'seq': the keys and values of each attention layer" in message
    assert "data-center network" in message
    assert result.compiled.slice_axis == "seq"


LIBTPU_BLOCKS = [
    block for block in PYTHON_BLOCKS if block.markers.get("needs") == "libtpu"
]


@jax_only
@needs_libtpu
@pytest.mark.parametrize("block", LIBTPU_BLOCKS, ids=lambda block: block.name)
def test_docs_blocks_needing_libtpu_print_what_their_page_shows(block, tmp_path):
    """Each docs block marked `<!-- needs: libtpu -->` (it compiles for a TPU
    topology) runs as written, as a script of its own (a fresh process names
    its layers as the page shows), and prints what its page shows
    (tests/test_docs_code_blocks.py: compile times masked where it says so)."""
    script = tmp_path / "block.py"
    script.write_text(block.code)
    environment = dict(
        os.environ,
        TPU_SKIP_MDS_QUERY="1",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
        ),
    )
    environment.pop("KERAS_DIST_CPU_DEVICES", None)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert block.name in OUTPUTS, f"{block.name} has no output block on its page"
    problems = output_problems(block, result.stdout)
    assert problems == [], "\n".join(problems)
