"""Context parallelism (`sequence_axis=`) with Keras' own attention layers.

A small decoder (token embedding, causal `keras.layers.MultiHeadAttention`
with a padding mask, a feed-forward block, logits per token) trains under
`DataParallel`, `FSDP` and a tensor-parallel `ModelParallel` with each
sequence split along a `"seq"` mesh axis, on 8 simulated CPU devices: the
weights, the logged loss and metrics, `evaluate` and `predict` equal plain
Keras on one device with the same global batch (fp32, 1e-5). The compiled
train step shows why it is worth it: per device, the activations of a long
sequence are a quarter of what splitting the batch alone leaves, and keys
and values are what is gathered. Bad input is refused before a step
compiles; TensorFlow and PyTorch refuse the argument at construction.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import once_per_run, run_job
from tests.untouched import Untouched
from tests.workers.context_parallel_models import (
    BATCH,
    LENGTH,
    SAMPLES,
    VOCABULARY,
    data,
    decoder,
    run,
)

jax_only = pytest.mark.backend("jax")


class TrainerDecoder(kd.Trainer, keras.Model):
    pass


def _mesh(shape, names):
    return kd.DeviceMesh(shape, names)


def _tensor_parallel(model: keras.Model) -> kd.ModelParallel:
    mesh = _mesh((2, 2, 2), ["batch", "seq", "model"])
    layout_map = kd.layouts.tensor_parallel(model, mesh)
    return kd.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch", sequence_axis="seq"
    )


# Each case: how the distribution is made (from the model, for the layout
# map), whether the run goes through `kd.Trainer` instead of a callback, and
# whether `evaluate` and `predict` run after `fit` (not in every case: each
# compiles two more steps, CI's time).
CASES = {
    "data_parallel_2x4": (
        lambda _: kd.DataParallel(_mesh((2, 4), ["batch", "seq"]), sequence_axis="seq"),
        False,
        True,
    ),
    "fsdp_2x4": (
        lambda _: kd.FSDP(
            _mesh((2, 4), ["batch", "seq"]), min_size=16, sequence_axis="seq"
        ),
        False,
        False,
    ),
    "data_parallel_1x8": (
        lambda _: kd.DataParallel(_mesh((1, 8), ["batch", "seq"]), sequence_axis="seq"),
        False,
        False,
    ),
    "fsdp_1x8_trainer": (
        lambda _: kd.FSDP(
            _mesh((1, 8), ["batch", "seq"]), min_size=16, sequence_axis="seq"
        ),
        True,
        True,
    ),
    "tensor_parallel_2x2x2": (_tensor_parallel, False, True),
}


class _FlashSeen(keras.callbacks.Callback):
    """What the attention layer's flash setting is while the call runs."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def on_train_batch_begin(self, batch, logs=None):
        layer = self.model.get_layer("attention")
        self.seen.append(
            (layer._flash_attention, keras.config.is_flash_attention_enabled())
        )


@pytest.fixture(scope="module")
def reference() -> dict:
    """Plain Keras on one device."""
    return run(decoder(), [])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("context_parallel_checkpoints")


@pytest.fixture(scope="module")
def distributed(checkpoints):
    """Each case's run, made once (the checkpoint test reads FSDP's)."""
    runs: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in runs:
            make, trainer, everything = CASES[case]
            callbacks = []
            if trainer:
                distribution = make(None)
                model = decoder(
                    base=functools.partial(TrainerDecoder, distribution=distribution)
                )
            else:
                model = decoder()
                distribution = make(model)
                callbacks.append(kd.DistributeCallback(distribution))
            if case == "fsdp_2x4":
                callbacks.append(kd.Checkpoint(checkpoints, save_freq="epoch"))
            seen = _FlashSeen()
            ran = run(model, [*callbacks, seen], fit_only=not everything)
            runs[case] = dict(
                ran,
                distribution=distribution,
                flash_during=seen.seen,
                flash_after=model.get_layer("attention")._flash_attention,
            )
        return runs[case]

    return get


@jax_only
@pytest.mark.parametrize("case", list(CASES))
def test_training_evaluate_and_predict_equal_plain_keras(case, reference, distributed):
    ours = distributed(case)
    assert ours["distribution"].sequence_axis == "seq"
    for mine, expected in zip(ours["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(mine, expected, atol=1e-5, rtol=0)
    assert set(ours["history"]) == set(reference["history"])
    for key, values in reference["history"].items():
        np.testing.assert_allclose(ours["history"][key], values, atol=1e-5, rtol=0)
    if "evaluate" not in ours:
        return
    assert set(ours["evaluate"]) == set(reference["evaluate"])
    for key, value in reference["evaluate"].items():
        np.testing.assert_allclose(ours["evaluate"][key], value, atol=1e-5, rtol=0)
    assert ours["predict"].shape == (SAMPLES, LENGTH, VOCABULARY)
    np.testing.assert_allclose(ours["predict"], reference["predict"], atol=1e-5)


@jax_only
def test_offloaded_optimizer_state_with_a_sequence_axis_trains_as_without(
    distributed,
):
    model = decoder()
    distribution = kd.DataParallel(
        _mesh((2, 4), ["batch", "seq"]), sequence_axis="seq", offload="optimizer"
    )
    ours = run(model, [kd.DistributeCallback(distribution)], fit_only=True)
    expected = distributed("data_parallel_2x4")["weights"]
    for got, want in zip(ours["weights"], expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    moments = [v for v in model.optimizer.variables if "moment" in v.name]
    assert {v.value.sharding.memory_kind for v in moments} == {"pinned_host"}


@jax_only
def test_tensor_parallel_case_splits_heads_on_the_model_axis(distributed):
    distribution = distributed("tensor_parallel_2x2x2")["distribution"]
    layout_map = distribution.layout_map
    split = [key for key in layout_map if "model" in tuple(layout_map[key].axes)]
    assert any("attention" in key and "query" in key for key in split), split
    assert any("up" in key for key in split), split


@jax_only
def test_fsdp_splits_large_variables_along_the_batch_and_the_sequence_axes():
    model = decoder()
    distribution = kd.FSDP(
        _mesh((2, 4), ["batch", "seq"]), min_size=16, sequence_axis="seq"
    )
    up = model.get_layer("up")  # kernel (16, 32), bias (32,)
    assert tuple(distribution.get_variable_layout(up.kernel).axes) == (
        "seq",
        "batch",
    )
    # One dimension: split along the batch axis, replicated along the other.
    assert tuple(distribution.get_variable_layout(up.bias).axes) == ("batch",)


@jax_only
def test_checkpoint_saved_with_a_sequence_axis_restores_on_one_device(
    distributed, checkpoints
):
    trained = distributed("fsdp_2x4")["weights"]
    model = decoder()
    assert kd.restore(model, checkpoints) == SAMPLES // BATCH
    for restored, expected in zip(model.get_weights(), trained, strict=True):
        np.testing.assert_array_equal(restored, expected)


# -- activations stay split: what XLA compiles -----------------------------------
@jax_only
def test_compiled_train_step_keeps_a_long_sequence_split_and_gathers_keys_values():
    """The same global batch (2 sequences of 512 tokens) on a (2, 4) mesh:
    with the batch split alone each device computes a whole sequence; with
    the sequence split too it computes a quarter, gathering only the keys and
    values (one all-gather each: [1, 512, heads, head size] per device)."""
    length, width, heads = 512, 32, 4

    def build():
        tokens = keras.Input((length,), dtype="int32")
        hidden = keras.layers.Embedding(64, width)(tokens)
        attended = keras.layers.MultiHeadAttention(heads, width // heads)(
            hidden, hidden, use_causal_mask=True
        )
        logits = keras.layers.Dense(64)(hidden + attended)
        model = keras.Model(tokens, logits)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    def train_step(sequence_axis):
        result = kd.plan(
            build,
            lambda mesh: kd.DataParallel(mesh, sequence_axis=sequence_axis),
            mesh={"batch": 2, "seq": 4},
            topology="cpu:8",
            batch_size=2,
            steps=("train",),
        )
        step = result.compiled.steps["train"]
        assert step.error is None
        return step

    with pytest.warns(UserWarning, match="replicates along the others"):
        batch_only = train_step(None)
    split = train_step("seq")
    assert split.temp_bytes < 0.35 * batch_only.temp_bytes
    assert batch_only.collective_counts["all-gather"] == 0
    keys_or_values = 1 * length * width * 4  # per device, gathered whole
    assert split.collective_counts["all-gather"] >= 2
    assert split.collective_bytes["all-gather"] >= 2 * keys_or_values


# -- bad input: refused before a step compiles -------------------------------------
@pytest.fixture
def compiled_functions():
    """The names of the functions JAX compiles while the test runs."""
    import jax  # noqa: PLC0415

    names: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kwargs.get("fun_name", "")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield names
    jax.monitoring.unregister_event_duration_listener(listen)


def _steps(names: list[str]) -> list[str]:
    return [name for name in names if "step" in name or "function" in name]


def _data_parallel_2x4() -> kd.DataParallel:
    return kd.DataParallel(_mesh((2, 4), ["batch", "seq"]), sequence_axis="seq")


def _refused_fit(model: keras.Model, x, y) -> str:
    """The `ValueError` `fit` under `(2, 4)` with a sequence axis raises."""
    with pytest.raises(ValueError) as error:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(_data_parallel_2x4())],
        )
    return str(error.value)


@jax_only
def test_a_length_the_axis_does_not_divide_is_refused_at_the_first_batch(
    compiled_functions,
):
    x, y, weights = data(length=10)
    message = _refused_fit(decoder(length=None), x, y)
    assert "'seq' splits each sequence into 4 equal chunks" in message
    assert "(8, 10)" in message and "multiple of 4" in message
    assert _steps(compiled_functions) == []


@jax_only
def test_refused_calls_leave_a_fresh_and_a_trained_model_as_they_were():
    """Refused in the first step, after Keras took the variables' values off
    them for it: they are given back, and everything else is as it was.
    First the fresh model's `fit`, then the trained model's `predict`."""
    x, y, _ = data(length=62)
    model = decoder(length=None)
    before = Untouched(model)
    message = _refused_fit(model, x, y)
    assert "(8, 62)" in message and "multiple of 4" in message
    before.check()
    # Plain Keras trains it, and so does the corrected call.
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    x, y, _ = data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        verbose=0,
        callbacks=[kd.DistributeCallback(_data_parallel_2x4())],
    )
    before = Untouched(model)
    with pytest.raises(ValueError, match="multiple of 4"):
        model.predict(
            data(length=62)[0],
            batch_size=BATCH,
            verbose=0,
            callbacks=[kd.DistributeCallback(_data_parallel_2x4())],
        )
    before.check()
    plain = model.predict(x, batch_size=BATCH, verbose=0)
    corrected = model.predict(
        x,
        batch_size=BATCH,
        verbose=0,
        callbacks=[kd.DistributeCallback(_data_parallel_2x4())],
    )
    np.testing.assert_allclose(corrected, plain, atol=1e-5, rtol=0)


@jax_only
def test_a_model_without_attention_is_refused_when_the_call_starts(
    compiled_functions,
):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)], name="mlp")
    model.compile(optimizer="adam", loss="mse")
    before = Untouched(model)
    built = len(compiled_functions)
    for call, arguments in [
        (model.fit, (np.zeros((8, 8)), np.zeros((8, 4)))),
        (model.predict, (np.zeros((8, 8)),)),
    ]:
        with pytest.raises(ValueError) as error:
            call(
                *arguments,
                verbose=0,
                callbacks=[kd.DistributeCallback(_data_parallel_2x4())],
            )
        message = str(error.value)
        assert "'mlp' has no attention layer" in message
        assert "Drop `sequence_axis`" in message
    assert compiled_functions[built:] == []  # refused before Keras ran anything
    before.check()


@jax_only
def test_a_layer_built_with_flash_attention_is_refused_when_the_call_starts(
    compiled_functions,
):
    model = decoder(flash_attention=True)
    x, y, _ = data()
    before = Untouched(model)
    built = len(compiled_functions)
    message = _refused_fit(model, x, y)
    assert "'attention' was built with flash_attention=True" in message
    assert "flash_attention=None or False" in message
    assert compiled_functions[built:] == []  # refused before Keras ran anything
    before.check()


@jax_only
@pytest.mark.parametrize("case", ["data_parallel_1x8", "fsdp_1x8_trainer"])
def test_keras_default_kernel_choice_becomes_xla_attention_for_the_call(
    case, distributed
):
    """Keras' attention leaves the kernel to the backend at each call (the
    layer's setting None, its default: on a TPU, the splash kernel): under a
    sequence axis each layer runs XLA's attention, and Keras' default comes
    back when the call ends."""
    ours = distributed(case)
    assert ours["flash_during"] == [(False, False)] * (SAMPLES // BATCH)
    assert ours["flash_after"] is None
    assert keras.config.is_flash_attention_enabled() is None


@jax_only
def test_an_output_layout_splitting_the_sequence_otherwise_is_refused():
    mesh = _mesh((2, 2, 2), ["batch", "seq", "model"])
    layout_map = kd.LayoutMap(mesh)
    layout_map["up/output"] = ("batch", "model", None)
    with pytest.raises(ValueError) as error:
        kd.ModelParallel(layout_map=layout_map, sequence_axis="seq")
    message = str(error.value)
    assert "'up/output'" in message and "('batch', 'model', None)" in message
    assert "sequence_axis='seq'" in message
    # The sequence axis itself on the second dimension is what it wants.
    fine = kd.LayoutMap(mesh)
    fine["up/output"] = ("batch", "seq", "model")
    assert kd.ModelParallel(layout_map=fine, sequence_axis="seq").sequence_axis


@jax_only
@pytest.mark.filterwarnings("ignore:DataParallel splits the batch:UserWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda mesh, axis: kd.DataParallel(mesh, sequence_axis=axis),
        lambda mesh, axis: kd.FSDP(mesh, sequence_axis=axis),
        lambda mesh, axis: kd.ModelParallel(
            mesh, kd.LayoutMap(mesh), batch_dim_name="batch", sequence_axis=axis
        ),
    ],
    ids=["DataParallel", "FSDP", "ModelParallel"],
)
def test_a_sequence_axis_must_be_another_axis_of_the_mesh_named_by_a_string(make):
    mesh = _mesh((2, 4), ["batch", "seq"])
    with pytest.raises(ValueError, match="must be an axis of the mesh") as error:
        make(mesh, "sequence")
    assert "Received: sequence_axis='sequence'" in str(error.value)
    assert "one of ['seq']" in str(error.value)  # what it accepts
    with pytest.raises(ValueError, match="must differ from the batch axis") as error:
        make(mesh, "batch")
    assert "one of ['seq']" in str(error.value)
    with pytest.raises(TypeError, match="the name of a mesh axis") as error:
        make(mesh, 1)
    assert "Received: sequence_axis=1" in str(error.value)


@jax_only
def test_data_parallel_with_the_sequence_axis_first_says_to_put_the_batch_axis_first():
    import warnings  # noqa: PLC0415

    mesh = _mesh((4, 2), ["seq", "batch"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not warned about first
        with pytest.raises(ValueError, match="put the batch axis first") as error:
            kd.DataParallel(mesh, sequence_axis="seq")
    assert "batch axis='seq'" in str(error.value)
    # FSDP names its batch axis (`axis="batch"`): any position will do.
    assert kd.FSDP(mesh, sequence_axis="seq").batch_dim_name == "batch"


@pytest.mark.backend("tensorflow", "torch")
@pytest.mark.parametrize("policy", ["DataParallel", "FSDP", "ModelParallel"])
def test_other_backends_refuse_a_sequence_axis_at_construction(policy):
    backend = keras.backend.backend()
    devices = kd.list_devices()[:2]
    mesh = kd.DeviceMesh((1, len(devices)), ["batch", "seq"], devices)
    make = {
        "DataParallel": lambda: kd.DataParallel(mesh, sequence_axis="seq"),
        "FSDP": lambda: kd.FSDP(mesh, sequence_axis="seq"),
        "ModelParallel": lambda: kd.ModelParallel(
            mesh, kd.LayoutMap(mesh), batch_dim_name="batch", sequence_axis="seq"
        ),
    }[policy]
    with pytest.raises(NotImplementedError) as error:
        make()
    message = str(error.value)
    assert f"does not split a sequence on {backend!r}" in message
    assert "KERAS_BACKEND=jax" in message


# -- two processes ----------------------------------------------------------------
# (2, 4): each process holds one batch row of the mesh, its sequences' four
# chunks on its own devices. (1, 8): the seq axis spans both processes; each
# process reads every row whole and JAX keeps the chunks of its own devices
# (`make_array_from_process_local_data` with the second dimension whole).
TWO_PROCESS_CASES = {
    "data_parallel_2x4": "data_parallel_2x4",
    "fsdp_1x8": "fsdp_1x8_trainer",
}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 processes x 4 CPU devices: each case's results, by process."""
    return once_per_run(
        tmp_path_factory,
        "context_parallel_two_processes",
        lambda directory: run_job(
            "context_parallel_worker.py",
            [",".join([*TWO_PROCESS_CASES, "own_data_1x8"])],
            processes=2,
            env={"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "4"},
            output_dir=directory,
        ),
    )


@jax_only
@pytest.mark.parametrize("case", list(TWO_PROCESS_CASES))
def test_two_processes_train_as_one_process_of_eight_devices(
    case, two_processes, distributed
):
    one_process = distributed(TWO_PROCESS_CASES[case])
    assert [result["processes"] for result in two_processes] == [2, 2]
    assert [result["devices"] for result in two_processes] == [8, 8]
    for result in two_processes:
        ours = result[case]
        for mine, expected in zip(ours["weights"], one_process["weights"], strict=True):
            np.testing.assert_allclose(mine, expected, atol=1e-5, rtol=0)
        for key, values in one_process["history"].items():
            np.testing.assert_allclose(ours["history"][key], values, atol=1e-5)
        np.testing.assert_allclose(
            ours["predict"], one_process["predict"], atol=1e-5, rtol=0
        )


@jax_only
def test_each_process_reading_its_own_rows_needs_the_sequence_axis_within_it(
    two_processes,
):
    for result in two_processes:
        message = result["own_data_1x8"]["error"]
        assert message is not None, "a (1, 8) mesh over 2 processes was not refused"
        assert "auto_shard_dataset=False" in message
        assert "sequence_axis='seq': put the sequence axis within a host" in message
        assert "Received: 1 batch shards for 2 processes" in message
