"""`DistributeCallback("auto")`, `kd.Auto`, `Trainer(distribution="auto")`,
`kd.plan(topology="local")` and `keras-dist plan --auto`.

The JAX tests share one cache directory (the module's), so a candidate
compiled by one is read by the next; every model is the same small MLP on
the 8 simulated CPU devices, whose memory is given (`device_memory=`):

    DataParallel's train step peaks at about 0.73 MiB a device, FSDP's at
    about 0.09 MiB, and the variables alone take 0.15 MiB unsplit.
"""

from __future__ import annotations

import pathlib

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import cli
from keras_dist.planner import auto_choice
from keras_dist.planner.candidates import Candidate
from keras_dist.training import auto
from tests.multiprocess import log_of, run_job

FITS_EVERYTHING = 2**30
DATA_PARALLEL_DOES_NOT_FIT = 700_000
NOTHING_FITS = 50_000
BATCH = 16


def _model(base=keras.Model):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    model = base(inputs, keras.layers.Dense(8)(hidden))
    model.compile(optimizer="adam", loss="mse")
    return model


def _data():
    x = np.random.RandomState(0).rand(64, 64).astype("float32")
    y = np.random.RandomState(1).rand(64, 8).astype("float32")
    return x, y


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("auto_cache"))


def _fit(model, callback, verbose=0):
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        callbacks=[callback],
        verbose=verbose,
    )
    return model.get_weights()


class _SeenAtStart(keras.callbacks.Callback):
    """What the auto callback says when Keras hands the model to callbacks,
    before any step compiles."""

    def __init__(self, watched):
        super().__init__()
        self.watched = watched
        self.seen = None

    def set_model(self, model):
        super().set_model(model)
        self.seen = self.watched.distribution


@pytest.mark.backend("jax")
def test_where_data_parallel_fits_it_is_chosen_and_trains_as_it(cache, capsys):
    callback = kd.DistributeCallback(kd.Auto(FITS_EVERYTHING, cache_dir=cache))
    seen = _SeenAtStart(callback)
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[seen, callback])
    choice = callback.choice
    assert isinstance(seen.seen, kd.DataParallel)  # concrete at the start
    assert choice.candidate == Candidate("data_parallel", {"batch": 8})
    assert (choice.source, choice.code) == ("compiled", "kd.DataParallel()")
    assert 0 < choice.peak_bytes <= choice.limit_bytes == int(0.9 * FITS_EVERYTHING)
    lines = [line for line in capsys.readouterr().out.splitlines() if "auto:" in line]
    assert len(lines) == 1 and "DataParallel fits" in lines[0]
    assert 'use kd.DataParallel() in place of "auto"' in lines[0]
    pinned = _fit(_model(), kd.DistributeCallback(kd.DataParallel()))
    for ours, theirs in zip(model.get_weights(), pinned, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
    # The same model's next call reuses the choice, silently.
    again = kd.DistributeCallback("auto")
    again.choose_for_call(model, "evaluate", {"x": x})
    assert again.choice is choice and "auto:" not in capsys.readouterr().out


@pytest.mark.backend("jax")
def test_where_data_parallel_does_not_fit_a_candidate_that_fits_trains(cache):
    callback = kd.DistributeCallback(
        kd.Auto(
            DATA_PARALLEL_DOES_NOT_FIT,
            candidates=["data_parallel", "fsdp"],
            cache_dir=cache,
        )
    )
    model = _model()
    weights = _fit(model, callback)
    choice = callback.choice
    assert choice.candidate == Candidate("fsdp", {"batch": 8})
    assert choice.peak_bytes <= choice.limit_bytes < choice.data_parallel_peak
    assert choice.reason.startswith("DataParallel does not fit: ")
    assert choice.code == "kd.FSDP()"
    pinned = _fit(_model(), kd.DistributeCallback(kd.FSDP()))
    for ours, theirs in zip(weights, pinned, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


@pytest.mark.backend("jax")
def test_nothing_fits_raises_before_any_step(cache):
    model = _model()
    steps = []
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: steps.append(batch)
    )
    auto_setting = kd.Auto(NOTHING_FITS, candidates=["data_parallel"], cache_dir=cache)
    callbacks = [counter, kd.DistributeCallback(auto_setting)]
    with pytest.raises(kd.OutOfDeviceMemoryError, match="Nothing fits") as raised:
        model.fit(*_data(), batch_size=BATCH, callbacks=callbacks, verbose=0)
    assert steps == [] and not model.optimizer.built
    assert "1. DataParallel, batch=8, remat off" in str(raised.value)
    assert "short a device" in str(raised.value)


@pytest.mark.backend("jax")
def test_verbose_0_is_silent_and_a_trainer_takes_auto(cache, capsys):
    class Net(kd.Trainer, keras.Model):
        pass

    model = _model(
        lambda i, o: Net(i, o, distribution=kd.Auto(FITS_EVERYTHING, cache_dir=cache))
    )
    assert model.choice is None
    _fit(model, keras.callbacks.Callback(), verbose=0)
    assert "auto:" not in capsys.readouterr().out
    assert model.choice.candidate.policy == "data_parallel"
    assert isinstance(model.distribution, kd.DataParallel)


@pytest.mark.backend("jax")
def test_the_cache_answers_the_next_run(cache):
    started = auto.plan_auto(
        _model(), batch_size=BATCH, auto=kd.Auto(FITS_EVERYTHING, cache_dir=cache)
    )
    assert started.searched == 1  # DataParallel fits: nothing else can win here
    assert started.search_seconds < 5  # read from the cache the first test wrote


@pytest.mark.backend("jax")
def test_cpu_devices_need_device_memory():
    with pytest.raises(ValueError, match=r"Auto\(device_memory=BYTES\)"):
        _fit(_model(), kd.DistributeCallback("auto"))


@pytest.mark.backend("jax")
def test_set_model_by_hand_needs_a_call():
    with pytest.raises(RuntimeError, match="chooses when a Keras fit"):
        kd.DistributeCallback("auto").set_model(_model())


@pytest.mark.backend("jax")
def test_plan_on_local_devices():
    result = kd.plan(
        _model, kd.FSDP, topology="local", batch_size=BATCH, device_memory=2**20
    )
    assert result.compiled.devices == 8 and result.fits
    assert result.compiled.topology == "local"
    with pytest.raises(ValueError, match="give no num_slices"):
        kd.plan(_model, kd.FSDP, topology="local", num_slices=2, batch_size=BATCH)


def mlp():
    """The model `keras-dist plan tests.test_auto:mlp --auto` plans."""
    return _model()


@pytest.mark.backend("jax")
def test_keras_dist_plan_auto_prints_the_line(cache, monkeypatch, capsys):
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])

    def run(*arguments):
        try:
            return cli.main(["plan", "tests.test_auto:mlp", *arguments])
        except SystemExit as exit_:
            return exit_.code

    memory = ["--device-memory", str(FITS_EVERYTHING), "--cache-dir", cache]
    assert run("--auto", "--batch-size", str(BATCH), *memory) == 0
    assert "keras_dist auto: DataParallel" in capsys.readouterr().out
    assert run("--auto", *memory) == 2
    assert "--auto needs --batch-size" in capsys.readouterr().err
    assert run("--auto", "--batch-size", str(BATCH), "--device-memory", "1000") == 1
    assert "keras-dist plan --auto: Nothing fits" in capsys.readouterr().err


@pytest.mark.backend("torch")
def test_torch_chooses_from_shapes(capsys):
    callback = kd.DistributeCallback(kd.Auto(FITS_EVERYTHING))
    _fit(_model(), callback, verbose=1)
    assert callback.choice.source == "shapes"
    assert callback.choice.code == "kd.DataParallel()"
    assert "from shapes" in capsys.readouterr().out
    with pytest.raises(kd.OutOfDeviceMemoryError, match="from shapes"):
        _fit(_model(), kd.DistributeCallback(kd.Auto(NOTHING_FITS)))


@pytest.mark.backend("tensorflow")
def test_tensorflow_chooses_data_parallel_from_shapes():
    callback = kd.DistributeCallback(kd.Auto(FITS_EVERYTHING))
    _fit(_model(), callback)
    assert callback.choice.candidate.policy == "data_parallel"
    assert callback.choice.source == "shapes"
    with pytest.raises(ValueError, match="leaves nothing the tensorflow backend"):
        _fit(_model(), kd.DistributeCallback(kd.Auto(1, candidates=["fsdp"])))


# -- without a backend ---------------------------------------------------------------
@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "arguments, error",
    [
        ({"device_memory": 0}, "`device_memory` must be a positive int"),
        ({"device_memory": True}, "`device_memory` must be a positive int"),
        ({"headroom": 1.0}, "`headroom` must be a share"),
        ({"candidates": ["pipeline"]}, "`candidates` must name some of"),
        ({"candidates": []}, "`candidates` must name some of"),
        ({"candidates": "fsdp"}, "`candidates` must be a list"),
        ({"cache_dir": 3}, "`cache_dir` must be True"),
    ],
)
def test_auto_refuses_bad_arguments(arguments, error):
    with pytest.raises((TypeError, ValueError), match=error):
        kd.Auto(**arguments)


@pytest.mark.backend_neutral
def test_plan_auto_needs_a_batch():
    with pytest.raises(ValueError, match="`batch_size` must be a positive int"):
        auto.plan_auto(_model, batch_size=0)


class _Row:
    def __init__(self, candidate, fits=True, step=None):
        self.candidate, self.fits, self.step_seconds = candidate, fits, step


@pytest.mark.backend_neutral
def test_the_rule_fastest_that_fits_then_the_simplest():
    dp = Candidate("data_parallel", {"batch": 8})
    fsdp = Candidate("fsdp", {"batch": 8})
    dp_remat = Candidate("data_parallel", {"batch": 8}, remat="dots")
    tp = Candidate("fsdp_tp", {"batch": 4, "model": 2})
    offload = Candidate("fsdp", {"batch": 8}, offload="optimizer")
    bf16 = Candidate("fsdp", {"batch": 8}, optimizer_state_dtype="bfloat16")
    # No step projected (CPUs): the simplest that fits.
    assert auto_choice.pick([_Row(tp), _Row(fsdp), _Row(dp)]).candidate == dp
    # Remat costs more than FSDP's collectives: FSDP without it wins the tie.
    assert auto_choice.pick([_Row(dp_remat), _Row(fsdp)]).candidate == fsdp
    assert auto_choice.pick([_Row(offload), _Row(dp_remat)]).candidate == dp_remat
    # The fastest wins; within 2 % it is a tie.
    rows = [_Row(dp, step=1.0), _Row(fsdp, step=0.9), _Row(tp, step=0.5)]
    assert auto_choice.pick(rows).candidate == tp
    rows = [_Row(dp, step=1.01), _Row(fsdp, step=1.0)]
    assert auto_choice.pick(rows).candidate == dp
    # bfloat16 state only where nothing that keeps the numbers fits.
    rows = [_Row(bf16, step=0.1), _Row(offload, step=1.0)]
    assert auto_choice.pick(rows).candidate == offload
    assert auto_choice.pick([_Row(bf16), _Row(dp, fits=False)]).candidate == bf16
    assert auto_choice.pick([_Row(dp, fits=False)]) is None


@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "candidate, code",
    [
        (Candidate("data_parallel", {"batch": 8}), "kd.DataParallel()"),
        (
            Candidate("fsdp", {"batch": 8}, remat="dots", offload="optimizer"),
            "kd.FSDP(remat='dots', offload='optimizer')",
        ),
        (
            Candidate("fsdp", {"batch": 4, "seq": 2}),
            "kd.FSDP(kd.DeviceMesh((4, 2), ('batch', 'seq')), sequence_axis=\"seq\")",
        ),
        (
            Candidate("fsdp_tp", {"batch": 4, "model": 2}),
            "mesh = kd.DeviceMesh((4, 2), ('batch', 'model')); kd.FSDP(mesh, "
            'layout_map=kd.layouts.tensor_parallel(model, mesh, model_axis="model"))',
        ),
        (
            Candidate("data_parallel", {"batch": 8}, optimizer_state_dtype="bfloat16"),
            "kd.DataParallel(optimizer_state_dtype='bfloat16')",
        ),
    ],
)
def test_the_code_that_pins_the_choice(candidate, code):
    assert auto_choice.pinned_code(candidate) == code


@pytest.mark.backend_neutral
def test_a_choice_travels_as_numbers():
    candidate = Candidate("fsdp_tp", {"batch": 4, "model": 2}, remat="full")
    choice = auto_choice.Choice(
        None, candidate, 123, 456, 789, 0.5, 2.0, "compiled", 3, 999, None
    )
    numbers = auto_choice.encode(choice)
    assert len(numbers) == auto_choice.WIDTH
    back = auto_choice.decode(numbers, lambda c: "made", None)
    assert back.candidate == candidate and back.distribution == "made"
    assert (back.peak_bytes, back.limit_bytes, back.step_seconds) == (123, 456, 0.5)
    assert back.data_parallel_peak == 999 and back.data_parallel_step is None
    assert back.reason == "DataParallel does not fit: 1.0 KiB of 0.4 KiB a device"


@pytest.mark.backend("jax")
def test_two_processes_make_process_0s_choice(tmp_path):
    """Process 0 compiles for both processes' devices (2 x 2) and tells the
    other; both train with the same distribution, and one line is said."""
    results = run_job(
        "auto_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "jax", "KERAS_DIST_CPU_DEVICES": "2"},
        output_dir=tmp_path,
    )
    first, second = results
    assert first["description"] == "FSDP, batch=4, remat off"
    assert first == second and first["devices"] == 4
    assert first["line"].count("DataParallel does not fit") == 1
    said = [log_of(tmp_path, rank).count("keras_dist auto:") for rank in (0, 1)]
    assert said == [1, 0]


@pytest.mark.backend("jax")
def test_a_generator_does_not_say_its_batch():
    def batches():
        x, y = _data()
        while True:
            yield x[:BATCH], y[:BATCH]

    callback = kd.DistributeCallback(kd.Auto(FITS_EVERYTHING))
    with pytest.raises(ValueError, match="cannot read it from x of type generator"):
        _model().fit(batches(), steps_per_epoch=1, callbacks=[callback], verbose=0)


class _OtherRank:
    """The adapter as process 1 of 2 sees it, process 0 having sent `sent`."""

    name = "jax"

    def __init__(self, sent):
        self.sent = sent

    def process_id(self):
        return 1

    def num_processes(self):
        return 2

    def gather_numbers(self, values, *, timeout_seconds):
        assert timeout_seconds > auto.SEARCH_BUDGET
        return [self.sent, values]


@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "status, error, words",
    [
        (auto_choice.NOTHING_FITS, kd.OutOfDeviceMemoryError, "nothing fits"),
        (auto_choice.FAILED, RuntimeError, "Process 0 failed while choosing"),
    ],
)
def test_the_other_processes_end_as_process_0_did(monkeypatch, status, error, words):
    sent = [status] + [0.0] * (auto_choice.WIDTH - 1)
    monkeypatch.setattr(auto, "get_adapter", lambda: _OtherRank(sent))
    with pytest.raises(error, match=words):
        auto.choose(_model(), "fit", {}, kd.Auto(FITS_EVERYTHING))
