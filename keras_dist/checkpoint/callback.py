"""`kd.Checkpoint`: Keras' `ModelCheckpoint` and `BackupAndRestore` in one, for
distributed runs: sharded, atomic checkpoints, and an exact resume."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

import keras
import numpy as np

from keras_dist._version import __version__
from keras_dist.backends import get_adapter
from keras_dist.checkpoint import damaged, store
from keras_dist.checkpoint import engine as engines
from keras_dist.checkpoint import state as checkpoint_state
from keras_dist.checkpoint.keys import saveable_variables
from keras_dist.checkpoint.preemption import PREEMPTED_EXIT_CODE, Preemption
from keras_dist.checkpoint.same_directory import require_same_directory
from keras_dist.common import job, random_streams
from keras_dist.faults import heartbeat, lifecycle
from keras_dist.keras_compat.callbacks import calling_callback_list
from keras_dist.keras_compat.epoch_iterator import (
    data_epoch,
    set_initial_epoch,
    start_next_epoch_at,
    watch_new_iterators,
    watch_next_epoch_data,
)
from keras_dist.runtime.join_check import require_joined

# The state of Keras' own callbacks that a resume needs (public attributes).
# EarlyStopping's `best_weights` (a copy of every weight) is not kept.
_CALLBACK_STATE = {
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_epoch"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "best", "cooldown_counter"),
    keras.callbacks.ModelCheckpoint: ("best",),
}


class Checkpoint(keras.callbacks.Callback):
    """Save the whole training state of a distributed `fit`, and resume it.

    When `fit` starts and `directory` holds a complete checkpoint, training
    resumes from the latest one at the exact step, mid-epoch included: the
    weights, the optimizer (slots, iteration count, loss scale), the metric
    states, the epoch and the batches done (the data goes on where it was,
    `shuffle=True` included), the random generators (Keras' seed generators,
    so Dropout goes on the same; NumPy's, Python's and torch's, which Keras
    shuffles with) and the state of `EarlyStopping`, `ReduceLROnPlateau`,
    `ModelCheckpoint` (`best`) and of any callback with `get_state()` /
    `set_state(state)` (JSON values).

    Each process writes only the shards it owns, with its backend's engine
    (Orbax on JAX, `torch.distributed.checkpoint` on PyTorch,
    `tf.train.Checkpoint` on TensorFlow); process 0 writes the manifest. A
    checkpoint appears atomically (`step-<N>/`, written as `.tmp-step-<N>/`
    and renamed once complete): a process killed at any moment leaves the
    previous checkpoint or the new one. `directory` must be one every process
    sees (a shared file system across hosts): processes given different paths
    are refused with a `ValueError` naming them when `fit` starts.

    A SIGTERM or SIGUSR1 to any process makes every process save at one
    agreed step (a few steps later) and exit with status 75
    (`PREEMPTED_EXIT_CODE`); `keras-dist launch --max-restarts K` then starts
    the job again and it resumes by itself.

    Every process must use it (saving and restoring are collective). Put it
    next to a `DistributeCallback` (or pass `checkpoint=` to `kd.Trainer`).

    Args:
        directory: where the `step-<N>` checkpoints go.
        save_freq: `"epoch"`, or a number of batches (a save due on an epoch's
            last batch is made at the epoch's end, after validation).
        max_to_keep: how many checkpoints stay (older ones are removed after
            a new one is committed); None keeps all.
        save_on_background: write while training goes on; the checkpoint is
            committed once written (at the latest at the next save or the end
            of `fit`).
        save_weights_only: the model's weights (and seed generators) only; a
            resume then restarts the optimizer and the metrics.
        monitor: the log value `save_best_only` compares (e.g. `"val_loss"`).
        mode: `"min"`, `"max"` or `"auto"` (max for accuracies and AUC-like
            names, else min), as in Keras' `ModelCheckpoint`.
        save_best_only: save only when `monitor` improved.
        on_damaged: what a resume does when the newest checkpoints are
            damaged (a file cut short or altered, a manifest that does not
            parse): `"warn"` resumes from the newest one that reads, warning
            with the damaged step, its file and the reason; `"raise"` stops
            with that error.

    Example:

    ```python
    model.fit(
        x, y, epochs=10,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint("checkpoints", save_freq=100),
        ],
    )
    ```
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        save_freq: str | int = "epoch",
        max_to_keep: int | None = 3,
        save_on_background: bool = True,
        save_weights_only: bool = False,
        monitor: str | None = None,
        mode: str = "auto",
        save_best_only: bool = False,
        *,
        on_damaged: str = "warn",
    ) -> None:
        super().__init__()
        if not isinstance(directory, str | os.PathLike) or not os.fspath(directory):
            raise TypeError(
                "`directory` must be a path (str or os.PathLike). Received: "
                f"{directory!r}"
            )
        if save_freq != "epoch" and (
            not isinstance(save_freq, int)
            or isinstance(save_freq, bool)
            or save_freq < 1
        ):
            raise ValueError(
                "`save_freq` must be 'epoch' or a positive number of batches. "
                f"Received: save_freq={save_freq!r}"
            )
        if max_to_keep is not None and (
            not isinstance(max_to_keep, int)
            or isinstance(max_to_keep, bool)
            or max_to_keep < 1
        ):
            raise ValueError(
                "`max_to_keep` must be a positive int or None (keep all). "
                f"Received: max_to_keep={max_to_keep!r}"
            )
        if mode not in ("auto", "min", "max"):
            raise ValueError(
                f"`mode` must be 'auto', 'min' or 'max'. Received: mode={mode!r}"
            )
        if monitor is not None and not isinstance(monitor, str):
            raise TypeError(
                "`monitor` must be a log name such as 'val_loss'. Received: "
                f"{monitor!r}"
            )
        if save_best_only and monitor is None:
            raise ValueError(
                "`save_best_only=True` needs `monitor`, the log value to compare "
                "(e.g. monitor='val_loss')."
            )
        for name, value in (
            ("save_on_background", save_on_background),
            ("save_weights_only", save_weights_only),
            ("save_best_only", save_best_only),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False. Received: {value!r}")
        self.directory = store.local_directory(directory, "kd.Checkpoint")
        # Found now, not after a whole epoch at the first save; whether it is
        # writable is tried when `fit` starts (each process creates nothing
        # before).
        problem = store.directory_problem(self.directory)
        if problem is not None:
            raise ValueError(problem)
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.save_on_background = save_on_background
        self.save_weights_only = save_weights_only
        self.monitor = monitor
        self.mode = mode
        self.save_best_only = save_best_only
        self.on_damaged = damaged.check_on_damaged(on_damaged)
        self.best: float | None = None
        self._siblings: Any = None
        self._pending: _PendingSave | None = None
        self._training = False

    # -- Keras hooks -------------------------------------------------------------
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._siblings = calling_callback_list()

    def on_train_begin(self, logs: dict | None = None) -> None:
        require_joined("`fit` with a `kd.Checkpoint`")  # else each rank is 0
        adapter = get_adapter()
        self._rank = adapter.process_id()
        self._processes = adapter.num_processes()
        self._timeout = job.timeout_seconds()
        # Before anything is written: one directory (not a per-rank TMPDIR).
        require_same_directory(
            self.directory, what="kd.Checkpoint", timeout_seconds=self._timeout
        )
        store.ensure_writable(self.directory, self._rank)
        self._preemption = Preemption(self.directory, self._rank, self._processes)
        self._preemption.start()
        self._training = True
        self._global_step = 0
        self._last_saved_step = 0
        # An int `save_freq` counts from the last check, saved or not (as
        # Keras' ModelCheckpoint does with `save_best_only`).
        self._last_checked_step = 0
        self._batches_done = 0
        self._epoch = 0
        self._epoch_start_step = 0
        self._epoch_random_state: list[int] = []
        self._resume: dict[str, Any] | None = None
        self._deferred_metrics: tuple[str, dict, list[str]] | None = None
        self._saved_metrics: dict[str, np.ndarray] = {}
        self._due_at_epoch_start: tuple[int, dict] | None = None
        self._random_state_at_first_batch: list[int] | None = None
        self._exit_after_epoch = False
        self._warned: set[str] = set()
        self._created_state: list[int] = []
        self._pending_created_state: list[int] | None = None
        self._pending_epoch_state: list[int] | None = None
        watch_new_iterators(self._before_new_iterator, self._after_new_iterator)
        steps, broken = store.scan(self.directory)
        # Processes that see different checkpoints (a directory that is not
        # shared) meet at different barriers: an error after the timeout.
        self._barrier(f"restore {steps[-1:]} {sorted(broken)[-1:]}")
        damaged.restore_newest(
            self.directory,
            self._restore,
            on_damaged=self.on_damaged,
            what="kd.Checkpoint",
            taking="resuming from",
            without="training starts from scratch",
        )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._save_due_at_epoch_start()
        if self._exit_after_epoch:
            self._save_and_exit()
        self._epoch = epoch
        self._batches_done = 0
        resume, self._resume = self._resume, None
        # Keras 3.16 shuffles from the training adapter's epoch counter, which
        # a resumed `fit` starts again from 0: the saved one is set back.
        watch_next_epoch_data(
            None if resume is None else resume["position"].get("data_epoch")
        )
        if resume is None:
            self._epoch_random_state = _random_state_words()
        else:
            set_initial_epoch(self.model, None)  # fit read it already
            position = resume["position"]
            for key, value in self._saved_metrics.items():
                self._metric_variables[key].assign(value)
            self._saved_metrics = {}
            self._set_sibling_states(resume.get("callbacks", {}))
            self._epoch_random_state = position["random_state"] or []
            # The epoch's data iterator is made next: the generators as they
            # were right before it was made, then (mid-epoch) as its first
            # batch was read.
            self._pending_created_state = position["random_state_created"]
            self._pending_epoch_state = position["random_state"]
            if position["batches_done"]:
                start_next_epoch_at(position["batches_done"])
                self._batches_done = position["batches_done"]
                # The skipped batches replay the data's draws, not the
                # training's (torch's unseeded Dropout draws from torch's
                # generator): the generators as they were at the save are put
                # back right before the first resumed batch.
                self._random_state_at_first_batch = position.get("random_state_now")
        self._epoch_start_step = self._global_step - self._batches_done

    def _before_new_iterator(self) -> None:
        words, self._pending_created_state = self._pending_created_state, None
        if words is not None:
            _set_random_state_words(words, data=True)
        self._created_state = _random_state_words(data=True)

    def _after_new_iterator(self) -> None:
        self._load_deferred_metrics()
        words, self._pending_epoch_state = self._pending_epoch_state, None
        if words is not None:
            _set_random_state_words(words)
        # What the epoch's first batch will draw from (NumPy shuffles then):
        # this, unless the iterator was made at the previous epoch's end, when
        # `on_epoch_begin` takes it again.
        self._epoch_random_state = _random_state_words()

    def _load_deferred_metrics(self) -> None:
        if self._deferred_metrics is None:
            return
        path, manifest, keys = self._deferred_metrics
        variables = saveable_variables(self.model)
        if any(key not in variables for key in keys):
            return  # not built yet
        self._deferred_metrics = None
        checkpoint_state.load(path, manifest, {key: variables[key] for key in keys})

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._deferred_metrics is not None and self._rank == 0:
            self._deferred_metrics = None
            warnings.warn(
                "kd.Checkpoint: the model's compiled metrics were not built when "
                "the resumed epoch started; its metrics count from the resumed "
                "batch on.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._deferred_metrics = None
        words, self._random_state_at_first_batch = (
            self._random_state_at_first_batch,
            None,
        )
        if words is not None:
            _set_random_state_words(words)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches_done = batch + 1
        self._global_step = self._epoch_start_step + self._batches_done
        if (
            isinstance(self.save_freq, int)
            and self._global_step - self._last_checked_step >= self.save_freq
        ):
            self._last_checked_step = self._global_step
            if self._batches_done == (self.params or {}).get("steps"):
                self._due_at_epoch_start = (self._global_step, {})
            else:
                self._save(self._mid_epoch_position(), logs or {})
        agreed = self._preemption.agreed_step(self._global_step)
        if agreed is not None and agreed == self._global_step:
            if self._batches_done == (self.params or {}).get("steps"):
                # The epoch's last batch: its end (validation, callbacks) runs
                # first, then the epoch-end save, then the exit.
                self._exit_after_epoch = True
            else:
                self._save_and_exit()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Saved once every callback ran its `on_epoch_end` (EarlyStopping and
        # ReduceLROnPlateau update their state there): at the next epoch's
        # start or at the end of `fit`.
        if (
            self.save_freq == "epoch"
            or self._due_at_epoch_start is not None
            or self._exit_after_epoch
        ):
            self._due_at_epoch_start = (self._global_step, dict(logs or {}))

    def on_train_end(self, logs: dict | None = None) -> None:
        try:
            self._save_due_at_epoch_start()
            # The state `fit` ends with, when no save took it (an int
            # `save_freq` that the last steps did not reach): a `fit` that
            # finds it trains nothing more. `save_best_only` saves only
            # improvements, as its checks decided.
            if self._global_step != self._last_saved_step and not self.save_best_only:
                self._save(self._epoch_end_position(), dict(logs or {}))
            # A background save is committed before `fit` returns.
            self._finish_pending()
            self._barrier(f"end {self._global_step}")
        finally:
            self._training = False
            self._preemption.stop()
            set_initial_epoch(self.model, None)

    # -- restoring ---------------------------------------------------------------
    def _restore(self, step: int) -> None:
        path, manifest = checkpoint_state.find_step(self.directory, step)
        weights_only = bool(manifest.get("weights_only"))
        state = checkpoint_state.match(
            self.model, manifest, path, weights_only=weights_only
        )
        checkpoint_state.load(path, manifest, state)
        # Metrics Keras builds only with the first batch (TensorFlow): loaded
        # once the first epoch's data iterator is made (keras_dist builds the
        # model from its specs then), after Keras reset them.
        unbuilt = [
            key
            for key in manifest["entries"]
            if key.startswith("metrics/") and key not in state and not weights_only
        ]
        self._deferred_metrics = (path, manifest, unbuilt) if unbuilt else None
        self._metric_variables = {
            key: variable
            for key, variable in state.items()
            if key.startswith("metrics/")
        }
        # Keras resets the metrics before the first epoch starts: they are put
        # back then (`on_epoch_begin`).
        self._saved_metrics = {
            key: np.array(keras.ops.convert_to_numpy(variable))
            for key, variable in self._metric_variables.items()
        }
        position = manifest["position"]
        set_initial_epoch(self.model, position["epoch"])
        self._global_step = self._last_saved_step = int(manifest["step"])
        self._last_checked_step = self._global_step
        self.best = manifest.get("best", self.best)
        self._resume = manifest
        if self._rank == 0:
            # An elastic job (a launcher that went on with fewer processes, a
            # Ray Train group resized) says so where it resumes: the one place
            # every way of starting the job passes.
            saved_by = manifest.get("world", {}).get("processes")
            size = (
                f"; saved by {saved_by} process(es), resuming on {self._processes}"
                " (the same global batch: each process' share changes)"
                if saved_by not in (None, self._processes)
                else ""
            )
            print(
                f"kd.Checkpoint: resuming from {path} (step {manifest['step']}: "
                f"epoch {position['epoch']}, batch {position['batches_done']}){size}",
                file=sys.stderr,
                flush=True,
            )

    # -- saving ------------------------------------------------------------------
    def _mid_epoch_position(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "batches_done": self._batches_done,
            "random_state_created": self._created_state,
            "random_state": self._epoch_random_state,
            "random_state_now": _random_state_words(),
            "data_epoch": data_epoch(),
        }

    def _save_due_at_epoch_start(self) -> None:
        if self._due_at_epoch_start is None:
            return
        _, logs = self._due_at_epoch_start
        self._due_at_epoch_start = None
        self._save(self._epoch_end_position(), logs, force=self._exit_after_epoch)

    def _epoch_end_position(self) -> dict[str, Any]:
        """The position of a save once an epoch's end ran: the next epoch."""
        return {
            "epoch": self._epoch + 1,
            "batches_done": 0,
            # The next epoch makes its data iterator when it starts, from the
            # generators as they are now (Keras made one at this epoch's end
            # too, which it does not use).
            "random_state_created": _random_state_words(data=True),
            "random_state": None,
            # The counter the next epoch shuffles from (Keras 3.16; None on 3.15).
            "data_epoch": data_epoch(),
        }

    def _save(
        self, position: dict[str, Any], logs: dict, *, force: bool = False
    ) -> bool:
        """Save the state at this step; `force`: even when `save_best_only`
        finds no improvement, and blocking (a preemption's save)."""
        step = self._global_step
        if self.save_best_only and not self._improved(logs) and not force:
            return False
        self._last_saved_step = step
        self._finish_pending()
        with heartbeat.phase("save"):
            if self._rank == 0:
                temporary = store.prepare(self.directory, step)
            else:
                temporary = store.temporary_directory(self.directory, step)
            self._barrier(f"save {step}")
            variables = checkpoint_state.state_to_save(
                self.model, weights_only=self.save_weights_only
            )
            manifest = self._manifest(variables, position)
            engine = engines.engine(manifest["engine"])
            background = self.save_on_background and not force
            pending = engine.save(temporary, variables, background=background)
            self._pending = _PendingSave(step, pending, manifest, self, background)
            if not background:
                self._finish_pending()
        return True

    def _manifest(
        self, variables: dict[str, Any], position: dict[str, Any]
    ) -> dict[str, Any]:
        distribution = keras.distribution.distribution()
        return {
            "engine": checkpoint_state.current_engine_name(),
            "backend": keras.backend.backend(),
            "keras_version": keras.__version__,
            "keras_dist_version": __version__,
            "weights_only": self.save_weights_only,
            "entries": checkpoint_state.entries(variables),
            "position": position,
            "callbacks": self._sibling_states(),
            "monitor": self.monitor,
            "best": self.best,
            "world": {
                "processes": self._processes,
                "distribution": repr(distribution) if distribution else None,
            },
        }

    def _improved(self, logs: dict) -> bool:
        value = logs.get(self.monitor)
        if value is None:
            if "monitor" not in self._warned and self._rank == 0:
                self._warned.add("monitor")
                warnings.warn(
                    f"kd.Checkpoint: `monitor={self.monitor!r}` is not in the logs "
                    f"({sorted(logs)}); nothing is saved until it is.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False
        value = float(value)
        mode = self.mode
        if mode == "auto":
            name = self.monitor.lower()
            mode = (
                "max"
                if ("acc" in name or "auc" in name or name.startswith("fmeasure"))
                else "min"
            )
        better = self.best is None or (
            value < self.best if mode == "min" else value > self.best
        )
        if better:
            self.best = value
        return better

    def _finish_pending(self) -> None:
        """Wait for the save in flight (every process), and on process 0 for
        its commit."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def _commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Process 0, once the whole checkpoint is written."""
        store.commit(self.directory, step, manifest)
        if self.max_to_keep is not None:
            store.prune(self.directory, self.max_to_keep, protect=step)

    def _save_and_exit(self) -> None:
        """The agreed preemption step: save, commit, leave."""
        step = self._global_step
        if self._last_saved_step != step:
            self._save(self._mid_epoch_position(), {}, force=True)
        self._finish_pending()
        self._barrier(f"preempted {step}")
        self._preemption.finish()
        print(
            f"keras-dist: rank {self._rank}: preempted "
            f"({self._preemption.describe()}): "
            f"saved step {step} into {self.directory}; exiting with status "
            f"{PREEMPTED_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        if lifecycle._installed:
            lifecycle.end_now(PREEMPTED_EXIT_CODE)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _barrier(self, name: str) -> None:
        get_adapter().barrier(
            f"keras_dist checkpoint {name}", timeout_seconds=self._timeout
        )

    # -- other callbacks' state ------------------------------------------------
    def _siblings_by_name(self) -> dict[str, Any]:
        callbacks = getattr(self._siblings, "callbacks", None) or []
        found: dict[str, Any] = {}
        counts: dict[str, int] = {}
        for callback in callbacks:
            if callback is self:
                continue
            kind = type(callback).__name__
            if not (
                type(callback) in _CALLBACK_STATE
                or (
                    callable(getattr(callback, "get_state", None))
                    and callable(getattr(callback, "set_state", None))
                )
            ):
                continue
            index = counts[kind] = counts.get(kind, -1) + 1
            found[f"{kind}/{index}"] = callback
        return found

    def _sibling_states(self) -> dict[str, Any]:
        states = {}
        for name, callback in self._siblings_by_name().items():
            attributes = _CALLBACK_STATE.get(type(callback))
            if attributes is None:
                states[name] = callback.get_state()
            else:
                states[name] = {
                    a: _plain(getattr(callback, a, None)) for a in attributes
                }
        return states

    def _set_sibling_states(self, states: dict[str, Any]) -> None:
        for name, callback in self._siblings_by_name().items():
            if name not in states:
                continue
            attributes = _CALLBACK_STATE.get(type(callback))
            if attributes is None:
                callback.set_state(states[name])
            else:
                for attribute, value in states[name].items():
                    setattr(callback, attribute, value)


class _PendingSave:
    """A save in flight: the engine's part, then process 0's commit."""

    def __init__(
        self,
        step: int,
        pending: Any,
        manifest: dict[str, Any],
        owner: Checkpoint,
        background: bool,
    ) -> None:
        self.step = step
        self.pending = pending
        self.manifest = manifest
        self.owner = owner
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.background = background
        if owner._rank == 0 and background:
            self.thread = threading.Thread(
                target=self._commit_when_written,
                name=f"keras-dist-checkpoint-{step}",
                daemon=True,
            )
            self.thread.start()

    def _commit_when_written(self) -> None:
        try:
            with lifecycle.removed_if_stopped(
                store.temporary_directory(self.owner.directory, self.step)
            ):
                self.pending.wait(self.owner._timeout)
                self.owner._commit(self.step, self.manifest)
        except BaseException as error:  # noqa: BLE001 (re-raised by finish)
            self.error = error

    def finish(self) -> None:
        if self.thread is not None:
            self.thread.join()
            if self.error is not None:
                raise RuntimeError(
                    f"kd.Checkpoint: rank 0 could not save step {self.step} into "
                    f"{self.owner.directory}: {self.error}"
                ) from self.error
            return
        self.pending.wait(self.owner._timeout)
        if not self.background:
            # Blocking save: every process' part is on disk before process 0
            # commits.
            self.owner._barrier(f"written {self.step}")
            if self.owner._rank == 0:
                with lifecycle.removed_if_stopped(
                    store.temporary_directory(self.owner.directory, self.step)
                ):
                    self.owner._commit(self.step, self.manifest)


def _plain(value: Any) -> Any:
    """A JSON value for a callback's attribute (NumPy scalars included)."""
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "numpy") and not isinstance(value, list | dict):
        return np.asarray(value).item()
    return value


def _streams(data: bool) -> list[Any]:
    adapter = get_adapter()
    streams = [adapter.random_stream()]
    if data:
        streams.append(adapter.data_random_stream())
    return streams


def _random_state_words(*, data: bool = False) -> list[int]:
    """NumPy's and Python's generators, the backend's (torch), and with
    `data` the one keras_dist shuffles with (TensorFlow, several workers)."""
    return random_streams.pack_random_states(_streams(data))


def _set_random_state_words(words: list[int], *, data: bool = False) -> None:
    random_streams.unpack_random_states(words, _streams(data))
