"""TensorFlow adapter: `DataParallel` on tf.distribute.

One process drives its local devices with `MirroredStrategy` (logical CPU
devices with `KERAS_DIST_CPU_DEVICES=N`); a multi-process job runs
`MultiWorkerMirroredStrategy`, whose `TF_CONFIG` comes from the cluster or from
an address exchange through the coordinator. The steps run inside Keras'
TF trainer (`strategy.run` under `tf.function`); keras_dist feeds each replica
its padded, masked rows and makes the metrics global. Sharded variables
(`ModelParallel`) raise `NotImplementedError`.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np
import tensorflow as tf

from keras_dist.backends.base import BackendAdapter
from keras_dist.backends.tensorflow import gradients, keras_steps
from keras_dist.backends.tensorflow import input_adapter as inputs
from keras_dist.backends.tensorflow import keras_internals as internals
from keras_dist.backends.tensorflow.iterator_reaper import REAPER
from keras_dist.cluster import rendezvous
from keras_dist.common import job
from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.padding import check_same_input, fingerprint
from keras_dist.common.random_streams import (
    STATE_WORDS,
    BackendStream,
    global_random_state,
    set_global_random_state,
)
from keras_dist.common.step_rows import warn_padded_once
from keras_dist.keras_compat.epoch_iterator import watch_batch_plans
from keras_dist.keras_compat.steps import install_cached_steps, remove_cached_steps

_NOT_YET = (
    "{what} is not implemented for the TensorFlow backend in keras_dist; "
    "DataParallel works, and KERAS_BACKEND=jax and torch have ModelParallel."
)


def _device_name(logical_device: Any) -> str:
    # Logical devices are named like "/device:CPU:0".
    index = logical_device.name.rsplit(":", 1)[-1]
    return f"{logical_device.device_type.lower()}:{index}"


def _tf_device(name: str) -> str:
    kind, _, index = str(name).partition(":")
    return f"/device:{kind.upper()}:{index or 0}"


def _tf_config(addresses: list[str], index: int) -> str:
    return json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    )


# Collective group keys each strategy of keras_dist's numbers its groups from.
_COLLECTIVE_KEY_RANGE = 100_000


class _MirroredStrategy(tf.distribute.MirroredStrategy):
    """A `MirroredStrategy` whose collective groups have keys of their own.

    Every `MirroredStrategy` numbers its collective groups from
    1 + `_collective_key_base` (0 by default), so two of them in one process --
    keras_dist's over 8 devices and another over 4, or the user's own -- join
    each other's groups and fail ("joining a group with size 4, but that group
    has size 8"). TensorFlow reads the base from the strategy when it builds
    its extended part.
    """

    def __init__(self, devices: tuple[str, ...], *, key_base: int):
        self._collective_key_base = key_base
        super().__init__(devices=list(devices))


class TensorFlowAdapter(BackendAdapter):
    name = "tensorflow"
    # Keras' step function takes the iterator and reads inside tf.function.
    reads_batches_in_python = False

    def __init__(self) -> None:
        super().__init__()
        self._mirrored: dict[tuple[str, ...], Any] = {}
        self._multi_worker: Any = None
        self._worker_index = 0
        self._num_workers = 1
        # Multi-worker with process 0's TF seed: Keras' own shuffled pipeline.
        self._keras_order = False

    def simulate_cpu_devices(self, count: int) -> None:
        # Imported here: this method is all of the adapter that needs it.
        from keras_dist.common import simulated_devices  # noqa: PLC0415

        cpus = tf.config.list_physical_devices("CPU")
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration()] * count
            )
        except RuntimeError as error:
            if "after being initialized" not in str(error):
                # Not the runtime having started: say what TensorFlow said.
                raise RuntimeError(
                    f"keras_dist could not simulate {count} CPU devices "
                    f"(KERAS_DIST_CPU_DEVICES={count}) on TensorFlow: {error}"
                ) from error
            present = len(tf.config.list_logical_devices("CPU"))
            if present != count:
                raise RuntimeError(
                    simulated_devices.too_late_message(
                        backend="TensorFlow",
                        requested=count,
                        present=present,
                        first_work="TensorFlow operation",
                        examples="a tensor, a Keras op, a device query",
                        set_at_start=simulated_devices.set_when_the_process_started(
                            count
                        ),
                    )
                ) from None

    def _local_devices(self, device_type: str | None) -> list[str]:
        if device_type is None:
            for candidate in ("TPU", "GPU"):
                if tf.config.list_logical_devices(candidate):
                    device_type = candidate
                    break
            else:
                device_type = "CPU"
        devices = tf.config.list_logical_devices(device_type.upper())
        return [_device_name(device) for device in devices]

    def list_devices(self, device_type: str | None = None) -> list[str]:
        local = self._local_devices(device_type)
        if self._multi_worker is None:
            return local
        # Each worker drives the devices its strategy replicates over.
        per_worker = len(self._multi_worker.extended.worker_devices)
        kind = local[0].split(":")[0] if local else "cpu"
        return [f"{kind}:{i}" for i in range(per_worker * self._num_workers)]

    def local_device_count(self, device_type: str | None = None) -> int:
        if self._multi_worker is not None:
            return len(self._multi_worker.extended.worker_devices)
        return len(self._local_devices(device_type))

    def num_processes(self) -> int:
        return self._num_workers

    def process_id(self) -> int:
        return self._worker_index

    def initialize(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_seconds: float,
    ) -> None:
        config = os.environ.get("TF_CONFIG")
        if not config:
            addresses = rendezvous.exchange_addresses(
                coordinator_address,
                num_processes,
                process_id,
                timeout_seconds=timeout_seconds,
            )
            os.environ["TF_CONFIG"] = _tf_config(addresses, process_id)
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=timeout_seconds
        )
        try:
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                communication_options=options
            )
        except Exception as error:
            raise RuntimeError(
                f"Process {process_id} of {num_processes} could not start "
                f"TensorFlow's multi-worker runtime (TF_CONFIG="
                f"{os.environ.get('TF_CONFIG')}): {error}"
            ) from error
        self._multi_worker = strategy
        self._num_workers = num_processes
        self._worker_index = process_id
        internals.install_multi_worker_fixes()

    def barrier(self, name: str, *, timeout_seconds: float) -> None:
        strategy = self._multi_worker
        if strategy is None or self._num_workers == 1:
            return
        # An all-reduce every worker joins; its timeout is the one the
        # strategy was created with (`CommunicationOptions`).
        try:
            ones = strategy.run(lambda: tf.constant(1.0))
            arrived = strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)
        except Exception as error:  # TF raises DeadlineExceeded, Unavailable...
            raise self._barrier_timed_out(name, timeout_seconds, error) from error
        expected = strategy.num_replicas_in_sync
        if int(arrived.numpy()) != expected:
            raise RuntimeError(
                f"Barrier {name!r}: {int(arrived.numpy())} of {expected} replicas "
                "arrived."
            )

    def gather_numbers(
        self, values: list[float], *, timeout_seconds: float
    ) -> list[list[float]]:
        numbers = [float(value) for value in values]
        strategy = self._multi_worker
        if strategy is None or self._num_workers == 1:
            return [numbers]
        # A sum over every replica of rows that are zero but for this worker's
        # own: one all-reduce, as `barrier` does, with the strategy's timeout.
        rows = np.zeros((self._num_workers, len(numbers)), "float64")
        rows[self._worker_index] = numbers
        try:
            mine = strategy.run(lambda: tf.constant(rows))
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, mine, axis=None)
        except Exception as error:  # TF raises DeadlineExceeded, Unavailable...
            raise self._barrier_timed_out("gather", timeout_seconds, error) from error
        replicas_per_worker = strategy.num_replicas_in_sync // self._num_workers
        return (total.numpy() / replicas_per_worker).tolist()

    def device_kind(self) -> str | None:
        for device_type in ("GPU", "TPU"):
            devices = tf.config.list_physical_devices(device_type)
            if devices:
                details = tf.config.experimental.get_device_details(devices[0])
                return details.get("device_name", device_type.lower())
        return "cpu"

    # -- layouts ---------------------------------------------------------------
    def to_backend_mesh(self, device_mesh: Any) -> Any:
        raise NotImplementedError(_NOT_YET.format(what="DeviceMesh.backend_mesh"))

    def to_backend_layout(self, tensor_layout: Any) -> Any:
        raise NotImplementedError(_NOT_YET.format(what="TensorLayout.backend_layout"))

    def distribute_tensor(self, tensor: Any, tensor_layout: Any) -> Any:
        raise NotImplementedError(_NOT_YET.format(what="distribute_tensor"))

    # -- strategies ------------------------------------------------------------
    def strategy(self, distribution: Any) -> Any:
        """The tf.distribute strategy that runs `distribution`.

        One `MultiWorkerMirroredStrategy` per multi-process job; otherwise one
        `MirroredStrategy` per set of devices, so that models built under
        `distribution.scope()` and the runs that train them share it.
        """
        self._check_layouts(distribution)
        names = [str(d) for d in np.asarray(distribution.device_mesh.devices).flat]
        if distribution.num_model_replicas != len(names):
            raise ValueError(
                "On TensorFlow every device is a replica that reads its own rows, "
                f"but this mesh's batch axis has {distribution.num_model_replicas} "
                f"of the {len(names)} devices. Use keras_dist.DataParallel, or a "
                "mesh whose other axes have size 1."
            )
        if self._multi_worker is not None:
            strategy = self._multi_worker
        else:
            available = self._local_devices(None) + self._local_devices("cpu")
            unknown = sorted(set(names) - set(available))
            if unknown:
                raise ValueError(
                    f"The mesh names devices this process does not have: {unknown}. "
                    f"It has {sorted(set(available))}; build the mesh from "
                    "keras_dist.list_devices()."
                )
            devices = tuple(_tf_device(name) for name in names)
            if devices not in self._mirrored:
                self._mirrored[devices] = _MirroredStrategy(
                    devices, key_base=_COLLECTIVE_KEY_RANGE * (1 + len(self._mirrored))
                )
            strategy = self._mirrored[devices]
        if distribution.num_model_replicas != strategy.num_replicas_in_sync:
            raise ValueError(
                f"The DataParallel mesh has {distribution.num_model_replicas} "
                f"devices but TensorFlow replicates over "
                f"{strategy.num_replicas_in_sync} ({self._num_workers} "
                "process(es)). Build the distribution from "
                "keras_dist.list_devices() after keras_dist.initialize()."
            )
        return strategy

    def scope(self, distribution: Any) -> Any:
        # A distribution TensorFlow cannot run (sharded variables, a model axis)
        # is still made global; training under it raises, naming why.
        try:
            strategy = self.strategy(distribution)
        except (NotImplementedError, ValueError):
            return contextlib.nullcontext()
        # A model built in this scope carries the strategy, so Keras builds it
        # from a batch of its own distributed dataset when `fit` starts, before
        # keras_dist's callback is called; Keras' averaging of the replicas'
        # pieces fails when the batch does not divide them (5, 5, 4, 4 rows).
        internals.install_multi_worker_fixes()
        return strategy.scope()

    def _check_layouts(self, distribution: Any) -> None:
        if distribution.shards_variables_along_batch:
            raise NotImplementedError(
                _NOT_YET.format(
                    what="FSDP (variables split along the data axis, through DTensor)"
                ).replace("has ModelParallel", "and torch have FSDP and ModelParallel")
            )
        layout_map = getattr(distribution, "layout_map", None) or {}
        for key in layout_map:
            axes = layout_map[key].axes
            if any(axis is not None for axis in axes):
                raise NotImplementedError(
                    _NOT_YET.format(
                        what=f"Sharding variables (here {key!r} as {tuple(axes)}, "
                        "through DTensor)"
                    )
                )

    # -- training --------------------------------------------------------------
    def _shared_seed(self, strategy: Any) -> int:
        """A seed drawn by process 0, the same in every process. NumPy's global
        generator is left where it was: Keras draws its own orders from it."""
        seed = 0
        if self._worker_index == 0:
            state = np.random.get_state()
            seed = np.random.randint(0, 2**31 - 1)
            np.random.set_state(state)
        return _process_zero_int(strategy, seed)

    def global_batches(
        self, data_adapter: Any, shuffle_stream: np.random.RandomState | None
    ) -> Any:
        """The adapter's global batches as a `tf.data.Dataset`.

        The dataset plain Keras iterates (`keras_tf_dataset`). In a
        multi-process job, input that Keras 3.15 shuffles from NumPy's global
        generator is shuffled from `shuffle_stream` (seeded by process 0)
        instead, so that every process reads the same batches in the same
        order (Keras 3.16 shuffles from the adapter's epoch counter: the same
        order everywhere already).
        """
        if (
            shuffle_stream is not None
            and internals.keras_shuffles(data_adapter)
            and not internals.shuffles_alike_everywhere(data_adapter)
            and not (self._keras_order and internals.shuffles_in_tf(data_adapter))
        ):
            return inputs.numpy_batches_dataset(data_adapter, shuffle_stream)
        return internals.keras_tf_dataset(data_adapter)

    def _take_process_zero_tf_seed(self, strategy: Any) -> bool:
        """Every process takes process 0's TensorFlow global seed.

        Keras shuffles arrays with `tf.random.shuffle` inside its own
        `tf.data` pipeline, whose seed comes from TensorFlow's global seed
        (`keras.utils.set_random_seed`). With process 0's seed every worker
        builds Keras' own pipeline and draws the order plain Keras draws on
        one device: a function of the seed only, whatever the worker count.
        Returns whether process 0 has a global seed.
        """
        seed = internals.tf_global_seed() if self._worker_index == 0 else None
        # 0: process 0 has none; seeds travel as seed + 1.
        shared = _process_zero_int(strategy, 0 if seed is None else seed + 1)
        if shared == 0:
            return False
        if internals.tf_global_seed() != shared - 1:
            tf.random.set_seed(shared - 1)
        return True

    def shuffle_stream(self, strategy: Any) -> np.random.RandomState | None:
        """NumPy stream for Keras' shuffling, seeded alike on every process."""
        if self._multi_worker is None:
            return None
        return np.random.RandomState(self._shared_seed(strategy))

    def data_random_stream(self) -> Any:
        """The multi-worker shuffle stream of the active run (`shuffle_stream`),
        None in one process (Keras shuffles from NumPy's global generator)."""
        stream = getattr(self, "_shuffle_stream", None)
        if stream is None:
            return None

        def get() -> np.ndarray:
            _, keys, position, has_gauss, cached = stream.get_state()
            return np.concatenate(
                [keys, [position, has_gauss], np.array([cached]).view("uint32")]
            ).astype("uint32")

        def put(words: np.ndarray) -> None:
            words = np.asarray(words, "uint32")
            cached = float(words[626:628].view("float64")[0])
            stream.set_state(
                ("MT19937", words[:624], int(words[624]), int(words[625]), cached)
            )

        return BackendStream(get=get, set=put)

    def _check_same_input(self, strategy: Any, dataset: Any) -> None:
        """Fail fast, naming them, when processes read different first batches."""
        batch = next(iter(dataset.take(1)), None)
        local = (
            0
            if batch is None
            else fingerprint(tf.nest.map_structure(np.asarray, batch))
        )
        # 56 bits as two exact int32 halves.
        halves = [local >> 28, local & (2**28 - 1)]

        def value(context: Any) -> Any:
            return tf.constant([halves], tf.int32)

        per_replica = strategy.experimental_distribute_values_from_function(value)
        everyone = strategy.gather(per_replica, axis=0).numpy()
        per_worker = everyone[:: len(strategy.extended.worker_devices)]
        check_same_input([int(hi) << 28 | int(lo) for hi, lo in per_worker])

    def activate(self, model: Any, distribution: Any) -> None:
        strategy = self.strategy(distribution)
        if self._multi_worker is not None and not distribution.auto_shard_dataset:
            raise NotImplementedError(
                "auto_shard_dataset=False (each process feeds its own data) is "
                "not implemented for multi-process TensorFlow in keras_dist: "
                "the processes would have to agree on every step's size inside "
                "tf.data. Give every process the same input and let keras_dist "
                "split it (auto_shard_dataset=True), or use KERAS_BACKEND=jax "
                "or torch."
            )
        steps_per_execution = getattr(model, "steps_per_execution", 1)
        if steps_per_execution != 1:
            raise ValueError(
                "steps_per_execution > 1 is not supported on the TensorFlow "
                "backend under a keras_dist distribution: Keras runs the steps "
                "of one execution in a tf.while_loop over the distributed "
                "iterator, which fails under tf.distribute strategies (plain "
                "Keras too, keras-team/keras#19246). Compile with "
                "steps_per_execution=1 (the default), or use KERAS_BACKEND=jax. "
                f"Received: steps_per_execution={steps_per_execution}"
            )
        local_devices = strategy.extended.worker_devices
        if getattr(model, "jit_compile", False) is True and (
            len(local_devices) > 1 and all("CPU" in d.upper() for d in local_devices)
        ):
            raise ValueError(
                "jit_compile=True cannot run on several CPU devices of one "
                "TensorFlow process: they are logical devices of one host, and "
                "XLA refuses a replica's step reading a variable of another "
                "logical device (TensorFlow's known issue 'tf.Variable on a "
                "different device'; plain Keras with its own MirroredStrategy "
                "fails the same). Compile with jit_compile=False or 'auto' (Keras "
                "turns XLA off under tf.distribute), or use KERAS_BACKEND=jax. "
                f"Received: jit_compile=True on devices {list(local_devices)}"
            )
        own = getattr(model, "_distribute_strategy", None)
        if (
            own is not None
            and own is not strategy
            and (own is not tf.distribute.get_strategy())
        ):
            raise ValueError(
                f"Model {model.name!r} was built in the scope of another "
                "tf.distribute strategy than this distribution's (your own, or "
                "another distribution's devices): TensorFlow cannot mix two "
                "strategies in one model. Build the model outside any "
                "strategy (keras_dist mirrors it when the call starts) or in "
                "`distribution.scope()`, or train it with your strategy and "
                f"without keras_dist. Received: {type(own).__name__} over "
                f"{list(own.extended.worker_devices)}"
            )
        internals.install_scalar_reads()
        self._on_deactivate(model, self._ordinary_between_calls(model, strategy))
        internals.attach_strategy(model, strategy)
        self._on_deactivate(model, internals.build_optimizer_in_scope(model, strategy))
        shuffle_stream = self._shuffle_stream = self.shuffle_stream(strategy)
        self._keras_order = self._multi_worker is not None and (
            self._take_process_zero_tf_seed(strategy)
        )
        unchecked = [self._multi_worker is not None]
        unprepared = [True]

        def batches_for_epoch(data_adapter: Any) -> Any:
            if self._multi_worker is not None:
                # Keras shuffles a PyDataset with Python's `random` when the
                # epoch starts: with process 0's generators every worker draws
                # process 0's order, the one plain Keras draws on one device.
                set_global_random_state(
                    _process_zero_words(strategy, global_random_state())
                )
            dataset = self.global_batches(data_adapter, shuffle_stream)
            if unchecked[0] and internals.reads_again(data_adapter):
                unchecked[0] = False
                # The check reads the first batch; the epoch then reads the
                # same order again, not the next one (a resumed run checks in
                # a later epoch and must draw as the first run did).
                drawn = shuffle_stream.get_state() if shuffle_stream else None
                generators = global_random_state()
                self._check_same_input(strategy, dataset)
                set_global_random_state(generators)
                if drawn is not None:
                    shuffle_stream.set_state(drawn)
            if unprepared[0]:
                unprepared[0] = False
                keras_steps.prepare(model, strategy, dataset.element_spec)
            return inputs.distributed_batches(
                strategy,
                dataset,
                num_workers=self._num_workers,
                worker_index=self._worker_index,
            )

        self._on_deactivate(model, internals.manage(strategy))
        # The user's own steps run as written (see `custom_steps`).
        user_steps = keras_steps.user_steps(model)
        keras_steps.install_unscaled_losses()
        if "train_step" in user_steps:
            self._on_deactivate(
                model, keras_steps.average_in_user_steps(model, strategy)
            )
        else:
            self._on_deactivate(
                model,
                gradients.fuse_gradient_all_reduce(getattr(model, "optimizer", None)),
            )
        if user_steps & {"train_step", "test_step"}:
            self._on_deactivate(
                model, _say_padding(model, user_steps, strategy.num_replicas_in_sync)
            )
        self._count_real_rows(model)
        self._average_gradients(model)
        # BatchNormalization leaves padding rows out and, by default,
        # normalizes over the whole global batch (one all-reduce per layer).
        together = GlobalBatchNorm.Replicas(
            sum=_sum_over_replicas,
            index=_replica_index,
            count=strategy.num_replicas_in_sync,
        )
        sync = getattr(distribution, "sync_batch_norm", True)
        self._normalize_batches(model, together if sync else GlobalBatchNorm.Replicas())
        internals.route_batches(batches_for_epoch)
        self._on_deactivate(model, internals.unroute_batches)
        # The traced steps of the previous call are reused when nothing they
        # depend on changed: no retracing (about a second) at every call.
        install_cached_steps(
            model, distribution, lambda: keras_steps.make_steps(model, user_steps)
        )
        self._on_deactivate(model, lambda: remove_cached_steps(model))

    def _ordinary_between_calls(self, model: Any, strategy: Any) -> Any:
        """Give `model` back its variables mirrored by an earlier call; return
        the undo that makes it an ordinary Keras model again when the call
        ends: plain TF variables, no strategy (the undo runs last).

        Kept as they are: a model built in the strategy's scope (the user's
        choice, as in Keras' own tf.distribute use), and a multi-process job,
        where reading a summed variable would be a collective of all workers.
        """
        strategies = [(model, model._distribute_strategy)] + [
            (optimizer, optimizer._distribution_strategy)
            for optimizer in internals.held_optimizers(model)
            if hasattr(optimizer, "_distribution_strategy")
        ]
        if strategies[0][1] is strategy or self._multi_worker is not None:
            return lambda: None
        internals.remirror_variables(model, strategy)

        def undo() -> None:
            internals.unmirror_variables(model, strategy)
            for owner, previous in strategies:
                if owner is model:
                    owner._distribute_strategy = previous
                else:
                    owner._distribution_strategy = previous

        return undo

    def deactivate(self, model: Any) -> None:
        self._undo_activation(model)

    @contextlib.contextmanager
    def call_starting(self, model: Any, name: str, distribution: Any) -> Any:
        """The call's `tf.data` iterators that Keras dropped are destroyed
        when it ends (on the reaper's threads), not found later: nothing
        the call made is left for the interpreter's exit to destroy."""
        try:
            yield
        finally:
            REAPER.collect()


def _process_zero_int(strategy: Any, value: int) -> int:
    """Process 0's `value` on every process (the others pass 0): one SUM over
    the replicas, of which only process 0's first replica gives it."""

    def replica_value(context: Any) -> Any:
        first = context.replica_id_in_sync_group == 0
        return tf.constant(value if first else 0, tf.int64)

    per_replica = strategy.experimental_distribute_values_from_function(replica_value)
    return int(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, None))


def _process_zero_words(strategy: Any, words: np.ndarray) -> np.ndarray:
    """Process 0's uint32 `words` on every process (one SUM over the replicas,
    of which only process 0's first replica gives them)."""
    mine = np.asarray(words, "int64")
    if mine.shape != (STATE_WORDS,):
        raise ValueError(f"Expected {STATE_WORDS} words, received {mine.shape}")

    def replica_value(context: Any) -> Any:
        first = context.replica_id_in_sync_group == 0
        return tf.constant(mine if first else np.zeros_like(mine))

    per_replica = strategy.experimental_distribute_values_from_function(replica_value)
    summed = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, None)
    return np.asarray(summed).astype("uint32")


def _replica_index() -> Any:
    return tf.distribute.get_replica_context().replica_id_in_sync_group


def _sum_over_replicas(value: Any) -> Any:
    """All-reduce in the replica step; its gradient is the gradients' sum."""
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


ADAPTER = TensorFlowAdapter()


def _say_padding(model: Any, user_steps: set[str], replicas: int) -> Any:
    """Warn, as each epoch's data iterator is made, when the user's own step
    will get padded batches (a global batch that does not divide the
    replicas); return the undo. The padding happens inside tf.data, so the
    batch sizes come from Keras' data adapter."""
    step = "train_step" if "train_step" in user_steps else "test_step"

    def record(_iterator: Any, plan: Any, input_type: str) -> None:
        if plan is None:
            job.warn_once(
                f"keras_dist pads a global batch that does not divide the {replicas} "
                f"replicas, and Keras cannot say the batch sizes of {input_type} "
                f"before reading them: {type(model).__name__}.{step} (your own) may "
                "get padding rows. Keras' compute_loss, compiled metrics and loss "
                "trackers leave them out; values your step computes itself from "
                "the raw tensors include them. Pass sample_weight to fit and use "
                "it, or give batches that divide the replicas.",
                UserWarning,
                key=("padded-unknown", id(model)),
            )
            return
        for rows in sorted({plan.batch_size, plan.last_rows}, reverse=True):
            if rows % replicas:
                padded = (rows + replicas - 1) // replicas * replicas
                warn_padded_once(model, step, rows, padded)

    return watch_batch_plans(record)
