"""The PyTorch checkpoint engine (torch.distributed.checkpoint), issue 12.

Written by 2 real processes (DDP and DTensor ModelParallel) and restored in
this one; written here and restored by 2 processes under ModelParallel and
DDP; each process writes only its shards; unfinished saves are refused.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tests.multiprocess import run_job

pytestmark = pytest.mark.backend("torch")

TORCH = {"KERAS_BACKEND": "torch"}
KERNEL = "layers/dense/vars/0"  # the first Dense's kernel: sharded by columns


@pytest.fixture(scope="module")
def engine():
    from keras_dist.backends.torch import checkpoint  # noqa: PLC0415

    return checkpoint


@pytest.fixture(scope="module")
def worker():
    from tests.workers import checkpoint_torch_worker  # noqa: PLC0415

    return checkpoint_torch_worker


@pytest.fixture(scope="module")
def job(tmp_path_factory, saved_here) -> tuple[list[list[dict]], pathlib.Path]:
    """The 2-process runs of this module in one job (each start-up costs
    seconds: CI's time): the save, then the restores of both checkpoints
    written here; each process' results in that order, and the save's
    directory."""
    output_dir = tmp_path_factory.mktemp("checkpoint_torch_save")
    directory = output_dir / "checkpoints"
    restored = [str(saved_here[background]["directory"]) for background in BACKGROUND]
    scenarios = ["save"] + ["restore"] * len(restored)
    results = run_job(
        "checkpoint_torch_worker.py",
        [",".join(scenarios), ",".join([str(directory), *restored])],
        processes=2,
        env=TORCH,
        output_dir=output_dir,
    )
    return results, directory


@pytest.fixture(scope="module")
def saved_by_two(job):
    results, directory = job
    return [runs[0] for runs in results], directory


def _state(worker, seed=77):
    from keras_dist.checkpoint.keys import saveable_variables  # noqa: PLC0415

    model = worker.build(seed=seed)
    return model, saveable_variables(model)


def _close(actual, expected, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol)


def _iterations(model):
    return int(np.asarray(model.optimizer.iterations))


@pytest.mark.parametrize("mode", ["ddp", "mp"])
def test_written_by_two_processes_restored_in_one(mode, saved_by_two, engine, worker):
    results, directory = saved_by_two
    saved = results[0][mode]
    assert results[0]["processes"] == 2
    assert results[0][mode]["predictions"] == results[1][mode]["predictions"]
    model, state = _state(worker)
    assert not np.allclose(worker.predict(model), saved["predictions"], atol=1e-3)
    engine.load(directory / mode, state, saved["entries"])
    _close(worker.predict(model), saved["predictions"])
    assert _iterations(model) == saved["iterations"] == 6
    # DDP: each process kept its own metric states; the checkpoint has their
    # sum, so one process restoring them gets the global results.
    results_now = {k: float(v) for k, v in model.get_metrics_result().items()}
    assert results_now == pytest.approx(saved["metrics"], abs=1e-6)


@pytest.mark.parametrize("mode", ["ddp", "mp"])
def test_read_arrays_gives_the_saved_values(mode, saved_by_two, engine):
    results, directory = saved_by_two
    saved = results[0][mode]
    arrays = engine.read_arrays(directory / mode, saved["entries"])
    assert sorted(arrays) == sorted(saved["entries"])
    for key, value in saved["values"].items():
        assert arrays[key].dtype == np.dtype(saved["entries"][key]["dtype"])
        _close(arrays[key], value, atol=0)


def test_model_parallel_each_process_writes_its_shards(saved_by_two):
    """The column-sharded kernel and its Adam moments: half of their bytes in
    each process' file; replicated values are written once, by process 0."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    results, directory = saved_by_two
    assert KERNEL in results[0]["mp"]["sharded"]
    assert results[0]["ddp"]["sharded"] == []
    metadata = dcp.FileSystemReader(str(directory / "mp")).read_metadata()
    kernel_keys = [KERNEL, "optimizer/vars/2", "optimizer/vars/3"]  # kernel, m, v
    half = 6 * 32 * 4  # bytes of one process' columns
    for key in kernel_keys:
        chunks = metadata.state_dict_metadata[key].chunks
        assert sorted(tuple(c.sizes) for c in chunks) == [(6, 32), (6, 32)]
        stored = [v for i, v in metadata.storage_data.items() if i.fqn == key]
        assert sorted(v.relative_path for v in stored) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        for info in stored:  # half the values, plus torch.save's header
            assert half <= info.length < half + 2048, (key, info)
    # Process 1 wrote its shards only: the parts of the sharded variables.
    sharded = {k for k, m in metadata.state_dict_metadata.items() if len(m.chunks) > 1}
    in_one = {
        i.fqn for i, v in metadata.storage_data.items() if "__1_" in v.relative_path
    }
    assert set(kernel_keys) <= in_one == sharded
    ddp = dcp.FileSystemReader(str(directory / "ddp")).read_metadata()
    written = [index for index in ddp.storage_data if index.fqn == KERNEL]
    assert len(written) == 1  # one copy, not one per process
    # Replicated values: process 0's copy (its value wins where they differ).
    assert {info.relative_path for info in ddp.storage_data.values()} == {
        "__0_0.distcp"
    }


BACKGROUND = [True, False]


@pytest.fixture(scope="module")
def saved_here(tmp_path_factory, engine, worker) -> dict[bool, dict]:
    """`_save_here` with and without a background save."""
    return {
        background: _save_here(background, tmp_path_factory, engine, worker)
        for background in BACKGROUND
    }


@pytest.fixture(scope="module", params=BACKGROUND, ids=["background", "blocking"])
def saved_by_one(request, saved_here):
    return saved_here[request.param]


def _save_here(background: bool, tmp_path_factory, engine, worker) -> dict:
    """Trained 2 epochs under a one-process DataParallel, saved here."""
    import keras  # noqa: PLC0415

    import keras_dist as kd  # noqa: PLC0415
    from keras_dist.checkpoint.keys import saveable_variables  # noqa: PLC0415

    directory = tmp_path_factory.mktemp("checkpoint_torch_one") / "one"
    directory.mkdir()
    model = worker.build(seed=3)
    x, y = worker.fit_data()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel())],
    )
    state = saveable_variables(model)
    expected = {k: np.asarray(v).copy() for k, v in state.items()}
    pending = engine.save(directory, state, background=background)
    # Captured: changing the variables now does not reach the checkpoint.
    model.layers[0].kernel.assign(keras.ops.zeros_like(model.layers[0].kernel))
    pending.wait(60)
    assert pending.done()
    model.layers[0].kernel.assign(expected[KERNEL])
    return {
        "background": background,
        "directory": directory,
        "entries": worker.entries_of(state),
        "values": expected,
        "predictions": worker.predict(model),
        "iterations": _iterations(model),
        "metrics": {k: float(v) for k, v in model.get_metrics_result().items()},
    }


def test_written_by_one_restored_in_one(saved_by_one, engine, worker):
    arrays = engine.read_arrays(saved_by_one["directory"], saved_by_one["entries"])
    for key, value in saved_by_one["values"].items():
        np.testing.assert_array_equal(arrays[key], value)
    model, state = _state(worker)
    engine.assign_arrays(state, arrays)
    _close(worker.predict(model), saved_by_one["predictions"])
    assert _iterations(model) == saved_by_one["iterations"] == 6


def test_written_by_one_restored_in_two(saved_by_one, job):
    """Into ModelParallel (DCP reads each process' shard; and full arrays
    through read_arrays + assign_arrays) and into DDP."""
    # The job's runs: the save, then a restore of each checkpoint written here.
    index = 1 + BACKGROUND.index(saved_by_one["background"])
    results = [runs[index] for runs in job[0]]
    metric_keys = sorted(k for k in saved_by_one["values"] if k.startswith("metrics/"))
    assert metric_keys
    for rank, result in enumerate(results):
        assert result["processes"] == 2
        for how in ("mp_load", "mp_assign", "ddp_load"):
            restored = result[how]
            _close(restored["predictions"], saved_by_one["predictions"])
            assert restored["iterations"] == saved_by_one["iterations"]
            assert restored["metrics"] == pytest.approx(
                saved_by_one["metrics"], abs=1e-6
            )
        for how in ("mp_load", "mp_assign"):
            assert result[how]["local_shapes"][KERNEL] == [6, 32]
            for key in metric_keys:  # global everywhere
                _close(result[how]["local_metrics"][key], saved_by_one["values"][key])
        # DDP: process 0 holds the restored sums, the others zeros.
        for key in metric_keys:
            expected = saved_by_one["values"][key] if rank == 0 else 0.0
            _close(result["ddp_load"]["local_metrics"][key], expected)
        assert result["ddp_load"]["local_shapes"] == {}


def _saved(tmp_path, engine, worker):
    directory = tmp_path / "step"
    directory.mkdir()
    model, state = _state(worker, seed=5)
    engine.save(directory, state, background=False).wait(10)
    return directory, worker.entries_of(state)


def test_unfinished_save_is_refused(tmp_path, engine, worker):
    directory, entries = _saved(tmp_path, engine, worker)
    (directory / ".metadata").unlink()  # killed before DCP's last write
    _, state = _state(worker)
    with pytest.raises(ValueError, match="was interrupted"):
        engine.load(directory, state, entries)
    with pytest.raises(ValueError, match="was interrupted"):
        engine.read_arrays(directory, entries)


def test_short_data_file_is_refused(tmp_path, engine, worker):
    directory, entries = _saved(tmp_path, engine, worker)
    data = directory / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    _, state = _state(worker)
    with pytest.raises(ValueError, match="'__0_0.distcp' is short"):
        engine.load(directory, state, entries)
    with pytest.raises(ValueError, match="'__0_0.distcp' is short"):
        engine.read_arrays(directory, entries)


def test_other_model_is_refused(tmp_path, engine, worker):
    import keras  # noqa: PLC0415

    from keras_dist.checkpoint.keys import saveable_variables  # noqa: PLC0415

    directory, entries = _saved(tmp_path, engine, worker)
    wider = keras.Sequential([keras.Input((7,)), keras.layers.Dense(64)])
    state = {KERNEL: saveable_variables(wider)[KERNEL]}
    with pytest.raises(ValueError, match=r"shape \(6, 64\).*has shape \(7, 64\)"):
        engine.load(directory, state, entries)
    with pytest.raises(ValueError, match="has no value for"):
        engine.load(directory, {"layers/nothing/vars/0": state[KERNEL]}, entries)


def test_engine_is_registered(engine):
    from keras_dist.checkpoint.engine import backend_engine  # noqa: PLC0415
    from keras_dist.checkpoint.engine import engine as engine_named  # noqa: PLC0415

    assert engine_named(backend_engine("torch")) is engine
    assert engine.ENGINE == "torch.distributed.checkpoint"
    assert pathlib.Path(engine.__file__).name == "checkpoint.py"


def test_through_kd_checkpoint_and_kd_restore(tmp_path, worker):
    """The engine under the core: `kd.Checkpoint` in `fit`, then `kd.restore`."""
    import keras_dist as kd  # noqa: PLC0415

    model = worker.build(seed=3)
    x, y = worker.fit_data()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(tmp_path / "checkpoints"),
        ],
    )
    restored, _ = _state(worker)
    assert kd.restore(restored, tmp_path / "checkpoints") == 6
    _close(worker.predict(restored), worker.predict(model))
    assert _iterations(restored) == _iterations(model) == 6
