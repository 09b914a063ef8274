"""A process that a launcher or a cluster started as one of several, whose
script forgot `kd.initialize()`, never trains alone and never writes as
process 0: `fit`/`evaluate`/`predict` under keras_dist, `kd.Checkpoint` and
`kd.export` fail before they start, naming the rank and the fix
(`keras_dist.runtime.join_check`). A process that is alone works unchanged.

Runs under every backend: the in-process tests with the cluster's variables
set in this process; the last one, under the real `keras-dist launch`, once.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import cluster
from keras_dist.backends import get_adapter
from keras_dist.common import job
from keras_dist.runtime.join_check import require_joined

BACKEND = keras.backend.backend()
REPOSITORY = pathlib.Path(__file__).resolve().parents[1]

# The variables each way of starting rank 1 of a job of 2 sets, and what the
# error must then name.
JOBS = {
    "launcher": (
        {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:29500",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": "1",
            "KERAS_DIST_LAUNCHER_PID": "12345",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },
        [
            "KERAS_DISTRIBUTION_NUM_PROCESSES='2'",
            "KERAS_DISTRIBUTION_PROCESS_ID='1'",
            "set by `keras-dist launch`",
        ],
    ),
    "torchrun": (
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },
        ["WORLD_SIZE='2'", "RANK='1'"],
    ),
    "slurm": (
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node1"},
        ["SLURM_NTASKS='2'", "SLURM_PROCID='1'"],
    ),
    "tf_config": (
        {
            "TF_CONFIG": json.dumps(
                {
                    "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
                    "task": {"type": "worker", "index": 1},
                }
            )
        },
        ["(TF_CONFIG)"],
    ),
    "jax": (
        {
            "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": "1",
        },
        ["JAX_NUM_PROCESSES='2'", "JAX_PROCESS_ID='1'"],
    ),
}


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    """No cluster variable of the shell leaks in, and `kd.initialize()` was
    not called (another test of this process may have called it)."""
    for name in [*cluster.ENVIRONMENT_VARIABLES, *JOBS["launcher"][0]]:
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(job, "_initialize_called", [])


def set_environment(monkeypatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


class TrainerNet(kd.Trainer, keras.Model):
    pass


def make_model(**trainer_options) -> keras.Model:
    """A tiny model; with options, a `kd.Trainer` given them."""
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(inputs)
    if trainer_options:
        model = TrainerNet(inputs, outputs, **trainer_options)
    else:
        model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


DATA = (np.ones((16, 4), "float32"), np.ones((16, 1), "float32"))


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.batches += 1

    on_test_batch_begin = on_predict_batch_begin = on_train_batch_begin


def distributed() -> kd.DistributeCallback:
    return kd.DistributeCallback(kd.DataParallel())


def forgot_initialize(rank: int = 1, count: int = 2):
    """`pytest.raises` for the error of rank `rank` of `count`."""
    return pytest.raises(
        RuntimeError,
        match=re.escape(f"Rank {rank} of {count} never joined its job")
        + r"(.|\n)*"
        + re.escape("Call `kd.initialize()`"),
    )


# -- a job of several processes, kd.initialize() forgotten ----------------------
@pytest.mark.parametrize("kind", sorted(JOBS))
def test_fit_under_a_job_fails_before_the_first_step_naming_rank_and_fix(
    monkeypatch, kind
):
    variables, named = JOBS[kind]
    set_environment(monkeypatch, variables)
    model = make_model()
    before = [weight.copy() for weight in model.get_weights()]
    counter = CountBatches()

    with forgot_initialize() as raised:
        model.fit(*DATA, batch_size=8, verbose=0, callbacks=[counter, distributed()])

    message = str(raised.value)
    for text in named:
        assert text in message, message
    assert "would run `fit` here alone" in message
    assert counter.batches == 0
    for old, new in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)
    # Nothing of keras_dist stays behind: the next call is plain Keras.
    assert keras.distribution.distribution() is None
    model.fit(*DATA, batch_size=8, verbose=0)


def test_evaluate_predict_and_the_trainer_fail_too(monkeypatch):
    set_environment(monkeypatch, JOBS["torchrun"][0])
    model = make_model()
    with forgot_initialize() as raised:
        model.evaluate(*DATA, batch_size=8, verbose=0, callbacks=[distributed()])
    assert "would run `evaluate` here alone" in str(raised.value)
    with forgot_initialize() as raised:
        model.predict(DATA[0], batch_size=8, verbose=0, callbacks=[distributed()])
    assert "would run `predict` here alone" in str(raised.value)

    trainer = make_model(distribution=kd.DataParallel())
    counter = CountBatches()
    with forgot_initialize():
        trainer.fit(*DATA, batch_size=8, verbose=0, callbacks=[counter])
    assert counter.batches == 0


def test_a_checkpoint_or_an_export_writes_nothing(monkeypatch, tmp_path):
    set_environment(monkeypatch, JOBS["launcher"][0])
    model = make_model()
    counter = CountBatches()
    directory = tmp_path / "checkpoints"

    # Without a DistributeCallback too: every rank would be process 0.
    with forgot_initialize() as raised:
        model.fit(
            *DATA,
            batch_size=8,
            verbose=0,
            callbacks=[counter, kd.Checkpoint(directory)],
        )
    assert "`fit` with a `kd.Checkpoint`" in str(raised.value)
    assert counter.batches == 0
    assert not directory.exists()

    with forgot_initialize() as raised:
        kd.export(model, tmp_path / "model.keras")
    assert "would run `kd.export` here alone" in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_unreadable_cluster_variables_fail_naming_them(monkeypatch):
    monkeypatch.setenv("RANK", "1")  # torchrun's, without WORLD_SIZE and the rest
    model = make_model()
    with pytest.raises(RuntimeError) as raised:
        model.fit(*DATA, batch_size=8, verbose=0, callbacks=[distributed()])
    message = str(raised.value)
    assert "cannot be read" in message
    assert "Received: RANK='1'" in message
    assert "call `kd.initialize()`" in message
    assert "unset them to run this process alone" in message


# -- alone, or joined ------------------------------------------------------------
ALONE = {
    "no cluster": {},
    "torchrun of one": {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    },
    "alone on purpose in a SLURM step of 2": {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "node1",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "1",
    },
}


@pytest.mark.parametrize("kind", sorted(ALONE))
def test_a_process_alone_trains_checkpoints_and_exports_unchanged(
    monkeypatch, tmp_path, kind
):
    set_environment(monkeypatch, ALONE[kind])
    model = make_model()
    counter = CountBatches()
    callbacks = [counter, distributed(), kd.Checkpoint(tmp_path / "checkpoints")]

    model.fit(*DATA, batch_size=8, verbose=0, callbacks=callbacks)
    kd.export(model, tmp_path / "model.keras")

    assert counter.batches == 2
    assert os.listdir(tmp_path / "checkpoints")
    assert (tmp_path / "model.keras").is_file()


def test_initialize_asked_for_one_process_is_the_users_choice(monkeypatch):
    set_environment(monkeypatch, JOBS["torchrun"][0] | {"RANK": "0"})
    model = make_model()
    with forgot_initialize(rank=0):
        model.fit(*DATA, batch_size=8, verbose=0, callbacks=[distributed()])

    kd.initialize(num_processes=1)

    counter = CountBatches()
    model.fit(*DATA, batch_size=8, verbose=0, callbacks=[counter, distributed()])
    assert counter.batches == 2


def test_a_job_the_backend_joined_by_itself_passes(monkeypatch):
    set_environment(monkeypatch, JOBS["torchrun"][0])
    with forgot_initialize():
        require_joined("`fit`")
    # torch.distributed.init_process_group or jax.distributed.initialize
    # called by the user: the backend says it is one of several.
    monkeypatch.setattr(get_adapter(), "num_processes", lambda: 2)
    require_joined("`fit`")


# -- under the real launcher -------------------------------------------------------
FORGETFUL_SCRIPT = """
import sys

import keras
import numpy as np

import keras_dist as kd

# kd.initialize() forgotten
print(f"started as rank {kd.process_id()} of {kd.num_processes()}", flush=True)
inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
callbacks = [kd.DistributeCallback(kd.DataParallel()), kd.Checkpoint(sys.argv[1])]
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
print("trained alone", flush=True)
"""


# The check is keras_dist's own, before any backend joins anything (each
# backend's `fit` reaching it runs above, in this process): under the real
# launcher once.
@pytest.mark.backend_neutral
def test_launched_processes_that_forgot_initialize_fail_at_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FORGETFUL_SCRIPT))
    directory = tmp_path / "checkpoints"
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in cluster.ENVIRONMENT_VARIABLES
        and not name.startswith(("KERAS_DIST", "SLURM_"))
    }
    env["KERAS_BACKEND"] = BACKEND
    if BACKEND != "torch":  # torch: one device per process
        env["KERAS_DIST_CPU_DEVICES"] = "2"
    command = [sys.executable, "-m", "keras_dist", "launch", "--nproc-per-node", "2"]

    start = time.monotonic()
    result = subprocess.run(
        [*command, str(script), str(directory)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPOSITORY,
        timeout=300,
    )
    elapsed = time.monotonic() - start

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "trained alone" not in output
    # The error a rank printed names that very rank (the launcher's label
    # says which rank printed it) and the fix.
    named = re.findall(
        r"^\[rank (\d)\] RuntimeError: Rank (\d) of 2 never joined its job.*"
        r"set by `keras-dist launch`.*Call `kd\.initialize\(\)`",
        result.stderr,
        re.M,
    )
    assert named and all(label == rank for label, rank in named), output
    assert not directory.exists()
    print(f"the launcher ended in {elapsed:.1f} s")
