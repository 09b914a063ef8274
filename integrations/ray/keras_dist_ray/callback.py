"""`ReportCallback`: a Keras 3 callback that reports to Ray Train."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from typing import Any

import keras
import numpy as np
import ray.train
from ray.train import collective

import keras_dist as kd
from keras_dist.checkpoint import store
from keras_dist.keras_compat.callbacks import calling_callback_list

_STEP = re.compile(r"^step-\d+$")


class ReportCallback(keras.callbacks.Callback):
    """Report each epoch's metrics, and `kd.Checkpoint`'s checkpoints, to Ray.

    At the end of every epoch every worker calls `ray.train.report` (Ray
    Train V2 wants the same number of calls from each) with the epoch's logs,
    which keras_dist makes global (the same on every process); Ray keeps
    those of the worker of rank 0. Ray Tune's schedulers and stoppers read
    them there.

    Given the `kd.Checkpoint` of the same `fit` (or its directory), the
    worker of rank 0 also attaches the latest committed checkpoint not
    reported yet, as a `ray.train.Checkpoint` holding its `step-<N>/`
    directory: `result.checkpoint.to_directory(d)` makes `d` a directory
    that `kd.Checkpoint(d)` resumes from and `kd.restore(model, d)` loads.
    A save is committed after the epoch that triggers it ends (at the next
    save or the end of `fit` when it is written in the background), so an
    epoch's report carries an earlier epoch's checkpoint; once `fit` ends, a
    last report (the final epoch's logs again) carries the final one if it
    was not reported yet. Put this callback after the `kd.Checkpoint` in
    `callbacks` (that order is checked) so that it sees that final commit.

    Where a restarted worker group resumes from: the `kd.Checkpoint`
    directory, which survives the workers (it must be one every worker sees:
    a local disk for one node, a shared file system across nodes). It holds
    the newest checkpoint, mid-epoch saves included. When that directory has
    no checkpoint yet and Ray has one (`ray.train.get_checkpoint()`: a run
    restored from its storage, a Ray Tune trial started from another's
    checkpoint), the worker of rank 0 copies Ray's into it before training
    starts, and `kd.Checkpoint` resumes from it.

    Args:
        checkpoint: the `kd.Checkpoint` callback of the same `fit`, or its
            directory; None reports metrics only.

    Example:

    ```python
    checkpoint = kd.Checkpoint("/shared/run-1/checkpoints")
    model.fit(x, y, epochs=10, callbacks=[
        kd.DistributeCallback(kd.DataParallel()),
        checkpoint,
        keras_dist_ray.ReportCallback(checkpoint),
    ])
    ```
    """

    def __init__(self, checkpoint: kd.Checkpoint | str | os.PathLike | None = None):
        super().__init__()
        self._checkpoint: kd.Checkpoint | None = None
        if checkpoint is None:
            self.directory = None
        elif isinstance(checkpoint, kd.Checkpoint):
            self._checkpoint = checkpoint
            self.directory = checkpoint.directory
        elif isinstance(checkpoint, str | os.PathLike) and os.fspath(checkpoint):
            self.directory = os.path.abspath(os.fspath(checkpoint))
        else:
            raise TypeError(
                "`checkpoint` must be the kd.Checkpoint callback of the same fit, "
                f"its directory, or None. Received: checkpoint={checkpoint!r}"
            )
        self._reported_step: int | None = None
        self._last_metrics: dict[str, float] = {}
        self._seeded = False

    # -- Keras hooks -------------------------------------------------------------
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._check_order(calling_callback_list())
        if self.directory is not None and not self._seeded:
            # Before any callback's `on_train_begin`: kd.Checkpoint looks for
            # a checkpoint to resume from there.
            self._seeded = True
            self._copy_ray_checkpoint_if_none()

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._last_metrics = {}
        if self.directory is not None and self._reported_step is None:
            # This attempt's first report attaches a checkpoint newer than the
            # one it resumed from (an earlier attempt reported that one).
            self._reported_step = self._on_rank_zero(
                lambda: store.latest_step(self.directory)
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._last_metrics = _plain_metrics(logs or {})
        self._report(self._last_metrics)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.directory is None:
            return
        newer = self._on_rank_zero(self._newer_step)
        if newer is not None:
            self._report(self._last_metrics, step=newer)

    # -- reporting ---------------------------------------------------------------
    def _report(self, metrics: dict[str, float], step: int | None = None) -> None:
        """`ray.train.report` on every worker; rank 0 attaches step `step`
        (default: the newest committed one not reported yet)."""
        if _rank() != 0 or self.directory is None:
            ray.train.report(metrics)
            return
        step = self._newer_step() if step is None else step
        staging = self._stage(step) if step is not None else None
        try:
            if staging is None:
                ray.train.report(metrics)
                return
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(staging)
            )
            self._reported_step = step
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def _newer_step(self) -> int | None:
        latest = store.latest_step(self.directory)
        if latest is None or latest == self._reported_step:
            return None
        return latest

    def _stage(self, step: int) -> str | None:
        """A directory holding `step-<N>/`, hard links to the committed files
        (a copy where links are not possible): kd.Checkpoint may prune the
        step while Ray uploads it. None when it was pruned already."""
        source = store.step_directory(self.directory, step)
        staging = tempfile.mkdtemp(prefix=".ray-report-", dir=self.directory)
        try:
            shutil.copytree(
                source,
                os.path.join(staging, os.path.basename(source)),
                copy_function=_link_or_copy,
            )
        except (FileNotFoundError, shutil.Error):
            shutil.rmtree(staging, ignore_errors=True)
            return None
        return staging

    def _on_rank_zero(self, compute):
        """`compute()` on the worker of rank 0, its value on every worker."""
        return collective.broadcast_from_rank_zero(compute() if _rank() == 0 else None)

    # -- restoring ---------------------------------------------------------------
    def _copy_ray_checkpoint_if_none(self) -> None:
        def copy() -> str | None:
            if store.latest_step(self.directory) is not None:
                return None
            checkpoint = ray.train.get_checkpoint()
            if checkpoint is None:
                return None
            os.makedirs(self.directory, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".ray-restore-", dir=self.directory)
            try:
                checkpoint.to_directory(staging)
                steps = [name for name in os.listdir(staging) if _STEP.match(name)]
                for name in steps:
                    os.replace(
                        os.path.join(staging, name), os.path.join(self.directory, name)
                    )
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            if not steps:
                warnings.warn(
                    f"ReportCallback: Ray's checkpoint {checkpoint.path} holds no "
                    "keras_dist step-<N> directory (it was not reported by "
                    f"ReportCallback); {self.directory} stays empty and training "
                    "starts from scratch.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return checkpoint.path

        # Every worker waits until rank 0 has copied.
        self._on_rank_zero(copy)

    def _check_order(self, callbacks: Any) -> None:
        if self._checkpoint is None or callbacks is None:
            return
        listed = list(getattr(callbacks, "callbacks", []))
        if not any(callback is self._checkpoint for callback in listed):
            raise ValueError(
                "ReportCallback was given a kd.Checkpoint that is not among this "
                "fit's callbacks: it saves nothing there. Pass it to fit too, "
                "before the ReportCallback. Received: "
                f"checkpoint={self._checkpoint!r}"
            )
        position = {id(callback): index for index, callback in enumerate(listed)}
        if position[id(self)] < position[id(self._checkpoint)]:
            raise ValueError(
                "ReportCallback must come after its kd.Checkpoint in `callbacks` "
                "(it reports what the checkpoint committed, the final save "
                "included). A kd.Trainer given `checkpoint=` adds it after fit's "
                "callbacks: give the kd.Checkpoint to fit instead, before the "
                "ReportCallback. Received the order: "
                f"{[type(callback).__name__ for callback in listed]}"
            )


def _rank() -> int:
    return ray.train.get_context().get_world_rank()


def _plain_metrics(logs: dict) -> dict[str, float]:
    """The logs as Python floats (Ray refuses tensors)."""
    return {
        name: float(np.asarray(keras.ops.convert_to_numpy(value)))
        for name, value in logs.items()
    }


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # file systems without hard links
        shutil.copy2(source, target)
