"""Keras' `gradient_accumulation_steps` under `kd.DataParallel`: k micro-batches
train the same weights as plain Keras on one device with one batch k times
larger (and as plain Keras with the same accumulation), with SGD + momentum
and with Adam. On PyTorch DDP all-reduces the gradients once per k steps; on
TensorFlow each replica accumulates its own and they are summed once per update.
On JAX they are all-reduced on every micro-step: a canary test fails when JAX
starts accepting what deferring the reduction needs.

JAX and TensorFlow: one process, 8 simulated devices (KERAS_DIST_CPU_DEVICES=8);
TensorFlow also a job of 2 workers. PyTorch: one job of 2 processes (gloo).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import run_job
from tests.workers import gradient_accumulation_worker as worker

PARITY = 1e-5


def _assert_parity(result: dict) -> None:
    for name in worker.OPTIMIZERS:
        trained = result[name]
        # One weight update per ACCUMULATION micro-steps (Keras counts them so).
        assert trained["iterations"] == worker.MICRO_STEPS // worker.ACCUMULATION
        assert trained["big_batch_iterations"] == trained["iterations"]
        for reference in ("plain_accumulation", "big_batch"):
            for ours, theirs in zip(
                trained["distributed"], trained[reference], strict=True
            ):
                np.testing.assert_allclose(
                    ours, theirs, atol=PARITY, rtol=0, err_msg=f"{name} {reference}"
                )


@pytest.mark.backend("jax", "tensorflow")
def test_accumulation_matches_one_big_batch_on_every_device():
    """Every simulated device (JAX 8, TensorFlow 4). On TensorFlow plain Keras
    cannot do this under a MirroredStrategy (its optimizer's `merge_call`
    inside a `tf.cond` raises)."""
    devices = kd.list_devices()
    assert len(devices) >= 4
    _assert_parity(worker.run(lambda: kd.DataParallel(devices=devices)))
    assert kd.distribution() is None


@pytest.mark.backend("tensorflow")
def test_accumulation_inside_a_replica_is_a_clear_error_on_tensorflow():
    """A LossScaleOptimizer applies its inner optimizer inside each replica,
    where TensorFlow rejects accumulation's conditional update (plain Keras
    under a MirroredStrategy raises a RuntimeError about `merge_call`)."""
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2, name="out")])
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(inner), loss="mse")
    x, y = worker.data()
    distribution = kd.DataParallel(devices=kd.list_devices()[:2])
    with pytest.raises(ValueError, match="gradient_accumulation_steps.*Loss"):
        model.fit(
            x,
            y,
            batch_size=8,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution)],
        )
    assert kd.distribution() is None


@pytest.mark.backend("torch")
@pytest.mark.parametrize("gradient_sync", ["after_backward", "ddp"])
def test_accumulation_all_reduces_once_per_update_on_torch(tmp_path, gradient_sync):
    """2 processes, the gradients averaged after backward (CPU's default) or
    by DDP (CUDA's): one gradient all-reduce per weight update (the model's
    gradients fit in one of DDP's buckets), none on the micro-steps in
    between (whose metric sums take an all-reduce of their own)."""
    results = run_job(
        "gradient_accumulation_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "torch", "KERAS_DIST_TORCH_GRADIENT_SYNC": gradient_sync},
        output_dir=tmp_path,
    )
    updates = worker.MICRO_STEPS // worker.ACCUMULATION
    for result in results:
        assert result["processes"] == 2
        _assert_parity(result)
        assert result["all_reduces"] == [updates] * len(worker.OPTIMIZERS)
    assert results[0] == results[1]


def _count_reduced_elements(monkeypatch: pytest.MonkeyPatch) -> object:
    """A counter, at run time, of the elements every batched cross-replica
    reduction sums (`tf.distribute.CrossDeviceOps.batch_reduce`, which
    `MirroredStrategy` runs for a replica's `all_reduce` and for
    `batch_reduce_to`): the counting op runs with the reduction, so one in a
    branch not taken counts nothing."""
    import tensorflow as tf

    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    reduce = tf.distribute.CrossDeviceOps.batch_reduce

    def counted(self, reduce_op, value_destination_pairs, options=None):
        elements = sum(
            tf.distribute.get_strategy()
            .experimental_local_results(value)[0]
            .shape.num_elements()
            for value, _ in value_destination_pairs
        )
        counter.assign_add(elements)
        return reduce(self, reduce_op, value_destination_pairs, options)

    monkeypatch.setattr(tf.distribute.CrossDeviceOps, "batch_reduce", counted)
    return counter


@pytest.mark.backend("tensorflow")
def test_tf_accumulates_per_replica_reduces_once_per_update_and_resumes(
    tmp_path, monkeypatch
):
    """4 replicas (every device of the suite's TensorFlow run), Adam, 2
    micro-steps an update, 48 rows in micro-batches of 16: an epoch is 3
    micro-steps, so it ends between two updates.

    Each replica keeps its own accumulators (after the epoch they hold that
    replica's gradient of micro-step 3, different on every replica), summed
    when read: Keras' accumulators then read what plain Keras holds on one
    device. The gradients cross replicas once per update (counted at run
    time), the metric states at every micro-step. A `kd.Checkpoint` written
    there and resumed by a fresh model loses no partial sum: the second epoch
    ends on the weights of plain Keras' 2 uninterrupted epochs."""
    from keras_dist.backends.tensorflow.keras_internals import tf_variable

    rows, epochs = 3 * worker.MICRO_BATCH, 2
    x, y = (part[:rows] for part in worker.data())
    devices = kd.list_devices()
    assert len(devices) >= 4

    def fit(model, epochs, *callbacks):
        model.fit(
            x,
            y,
            batch_size=worker.MICRO_BATCH,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
        return model

    def model():
        worker.worker_seed.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        adam = keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
        model.compile(optimizer=adam, loss="mse")
        return model

    def accumulators(model):
        return [
            v for v in model.optimizer.variables if "gradient_accumulator" in v.path
        ]

    plain_one_epoch = fit(model(), 1)
    plain = fit(model(), epochs)

    class CopiesAtTheEnd(keras.callbacks.Callback):
        """Each replica's accumulators when the run ends (after the call the
        model's variables are plain ones again, holding their sum)."""

        copies: list = []

        def on_train_end(self, logs=None):
            strategy = self.model.distribute_strategy
            self.copies[:] = [
                [
                    np.asarray(c)
                    for c in strategy.experimental_local_results(tf_variable(a))
                ]
                for a in accumulators(self.model)
            ]

    reduced = _count_reduced_elements(monkeypatch)
    distribution = kd.DataParallel(devices=devices)
    checkpoints = tmp_path / "checkpoints"
    first = fit(
        model(),
        1,
        CopiesAtTheEnd(),  # before the run ends: at DistributeCallback's
        kd.DistributeCallback(distribution),
        kd.Checkpoint(checkpoints),
    )
    parameters = sum(int(np.prod(w.shape)) for w in first.trainable_weights)
    metric_states = sum(int(np.prod(v.shape)) for v in first.metrics_variables)
    assert parameters > metric_states
    # 3 micro-steps: 3 metric all-reduces, 1 reduction of the accumulators.
    assert int(reduced.numpy()) == 3 * metric_states + parameters
    assert int(first.optimizer.iterations.numpy()) == 1

    ours, theirs = accumulators(first), accumulators(plain_one_epoch)
    assert len(ours) == len(theirs) == len(first.trainable_weights)
    assert len(CopiesAtTheEnd.copies) == len(ours)
    for accumulator, reference, copies in zip(
        ours, theirs, CopiesAtTheEnd.copies, strict=True
    ):
        assert len(copies) == len(devices)
        assert not any(np.allclose(copies[0], c, atol=1e-6) for c in copies[1:])
        assert np.abs(reference.numpy()).max() > 1e-3
        np.testing.assert_allclose(sum(copies), reference.numpy(), atol=PARITY, rtol=0)
        np.testing.assert_allclose(
            accumulator.numpy(), reference.numpy(), atol=PARITY, rtol=0
        )
    for ours, theirs in zip(
        first.get_weights(), plain_one_epoch.get_weights(), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, atol=PARITY, rtol=0)

    resumed = fit(
        model(),
        epochs,
        kd.DistributeCallback(distribution),
        kd.Checkpoint(checkpoints),
    )
    assert resumed.history.epoch == [1]  # resumed where the first fit ended
    assert int(resumed.optimizer.iterations.numpy()) == epochs * 3 // 2
    for ours, theirs in zip(resumed.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=PARITY, rtol=0)
    assert kd.distribution() is None


@pytest.mark.backend("tensorflow")
def test_tf_accumulation_across_two_workers(tmp_path):
    """2 processes (`MultiWorkerMirroredStrategy`, loopback), Adam: the update
    step's reduction of the per-replica accumulators is a collective
    all-reduce inside the step's `tf.cond`, which every worker takes alike."""
    results = run_job(
        "gradient_accumulation_tf_worker.py",
        [],
        processes=2,
        env={"KERAS_BACKEND": "tensorflow"},
        output_dir=tmp_path,
    )
    references = {
        "plain_accumulation": worker.train("adam", accumulate=True),
        "big_batch": worker.train("adam", accumulate=False),
    }
    for result in results:
        assert result["processes"] == 2
        assert result["iterations"] == worker.MICRO_STEPS // worker.ACCUMULATION
        for name, reference in references.items():
            for ours, theirs in zip(
                result["distributed"], worker.weights(reference), strict=True
            ):
                np.testing.assert_allclose(
                    ours, theirs, atol=PARITY, rtol=0, err_msg=name
                )
    assert results[0] == results[1]


@pytest.mark.backend("jax")
def test_jax_still_cannot_defer_the_gradient_reduction():
    """Why JAX all-reduces on every micro-step: a canary that fails when JAX
    starts accepting what reduce-once accumulation needs, so that it gets built.

    Deferring the reduction keeps each device's partial gradient unreduced
    across micro-steps. JAX 0.10 holds unreduced values only on `Explicit`
    mesh axes (keras_dist's meshes are `Auto`, as Keras' are), and there its
    sharding rules reject the first thing every Keras model does with such a
    weight: a Dense layer's bias added to batch-split activations (also
    convolutions, embedding gathers and Dropout's select; measured on JAX
    0.10.2). Running the step per device instead (`shard_map`) would change
    BatchNorm statistics, dropout masks and the loss' normalisation, which
    plain Keras computes over the whole batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()[:8]
    assert len(devices) == 8  # KERAS_DIST_CPU_DEVICES=8, as the suite runs
    auto = jax.sharding.Mesh(np.array(devices), ("batch",))
    with pytest.raises(ValueError, match="Explicit"):
        NamedSharding(auto, P(None, unreduced={"batch"}))

    mesh = jax.sharding.Mesh(
        np.array(devices), ("batch",), axis_types=(AxisType.Explicit,)
    )
    kernel = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P()))
    bias = jax.device_put(jnp.ones((2,)), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("batch")))

    def loss(kernel, bias, x):
        return jnp.mean((x @ kernel + bias) ** 2)

    @jax.jit
    def partial_gradients(kernel, bias, x):
        kernel = jax.reshard(kernel, P(None, None, reduced={"batch"}))
        bias = jax.reshard(bias, P(None, reduced={"batch"}))
        return jax.grad(loss, argnums=(0, 1))(kernel, bias, x)

    with jax.set_mesh(mesh):
        with pytest.raises(Exception, match="reduced on") as raised:
            partial_gradients(kernel, bias, x)
    assert type(raised.value).__name__ == "ShardingTypeError"
