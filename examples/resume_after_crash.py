"""Resume after a crash: a job that loses a process carries on where it was.

Trains a small classifier on the 8x8 handwritten digits that scikit-learn
ships (no download) with `keras_dist.DataParallel` over 2 processes, saving a
sharded checkpoint every `--save-freq` steps with `keras_dist.Checkpoint`.
`--crash-at-step K` makes the last process kill itself (SIGKILL, no clean-up)
after global step K, in the first attempt only; `keras-dist launch
--max-restarts 1` then starts the whole job again and `fit` resumes by itself
from the latest complete checkpoint, mid-epoch included, and ends with the
same weights as a run that never crashed.

    keras-dist launch --nproc-per-node 2 --max-restarts 1 \\
        examples/resume_after_crash.py --crash-at-step 25
    KERAS_BACKEND=torch keras-dist launch --nproc-per-node 2 --max-restarts 1 \\
        examples/resume_after_crash.py --crash-at-step 25
    KERAS_BACKEND=tensorflow keras-dist launch --nproc-per-node 2 --max-restarts 1 \\
        examples/resume_after_crash.py --crash-at-step 25

Which checkpoint the job resumes from: with `--crash-at-step 25 --save-freq
10`, step 20's, or step 10's when the crash came before step 20's background
save was written. A background save (the default) is committed once every
process has written its part, while training goes on; a process killed a few
steps after the save started (on a busy machine, or at step 21) takes the
unwritten save with it. `--blocking-saves` (`save_on_background=False`)
finishes every save before training goes on: the job then always resumes from
the latest save before the crash (step 20), at the cost of a pause per save.

Without the launcher, run the same command twice: the first run crashes, the
second resumes (`python examples/resume_after_crash.py --crash-at-step 25`).
Checkpoints go to `--checkpoint-dir` (every process must see it); a directory
that holds a finished run leaves nothing to train: remove it to start again.
JAX and TensorFlow simulate `KERAS_DIST_CPU_DEVICES` (default 2) CPU devices
in each process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Both must be set before Keras and the backend start.
os.environ.setdefault("KERAS_BACKEND", "jax")
if os.environ["KERAS_BACKEND"] != "torch":  # PyTorch: one device a process
    os.environ.setdefault("KERAS_DIST_CPU_DEVICES", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_dist as kd  # noqa: E402


def load_data() -> tuple[np.ndarray, np.ndarray]:
    digits = load_digits()
    return (digits.data / 16.0).astype("float32"), digits.target  # (1797, 64)


def build_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


class ResumeReport(keras.callbacks.Callback):
    """Notes the step `fit` starts at (after `kd.Checkpoint` restored) and
    simulates the crash: the last process kills itself after global step
    `crash_at_step`, unless this run resumed or is a restart."""

    def __init__(self, crash_at_step: int | None) -> None:
        super().__init__()
        self.crash_at_step = crash_at_step
        self.restart = int(os.environ.get("KERAS_DIST_RESTART_COUNT", "0"))
        self.started_at = 0

    def on_train_begin(self, logs=None):
        iterations = self.model.optimizer.iterations
        self.started_at = int(keras.ops.convert_to_numpy(iterations))

    def on_train_batch_end(self, batch, logs=None):
        if self.crash_at_step is None or self.restart or self.started_at:
            return
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        if step == self.crash_at_step and kd.process_id() == kd.num_processes() - 1:
            print(
                f"Simulating a crash: process {kd.process_id()} kills itself after "
                f"step {step}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--save-freq", type=int, default=10, help="steps")
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument(
        "--blocking-saves",
        action="store_true",
        help="finish each save before training goes on (save_on_background=False)",
    )
    parser.add_argument("--checkpoint-dir", default="resume_after_crash_checkpoints")
    parser.add_argument("--output", default=None, help="final weights (.npz)")
    arguments = parser.parse_args()

    kd.initialize()
    x, y = load_data()
    model = build_model()
    report = ResumeReport(arguments.crash_at_step)
    keras.utils.set_random_seed(0)
    history = model.fit(
        x,
        y,
        batch_size=arguments.batch_size,
        epochs=arguments.epochs,
        shuffle=True,
        verbose=2 if kd.process_id() == 0 else 0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            kd.Checkpoint(
                arguments.checkpoint_dir,
                save_freq=arguments.save_freq,
                save_on_background=not arguments.blocking_saves,
            ),
            report,
        ],
    )
    weights = model.get_weights()  # every process: reading may be collective
    if kd.process_id() != 0:
        return
    steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    if report.started_at:
        print(
            f"Resumed from step {report.started_at} (restart {report.restart}); "
            f"trained to step {steps}"
        )
    else:
        print(f"Trained from scratch to step {steps}")
    if history.history.get("loss"):
        last = {name: values[-1] for name, values in history.history.items()}
        print(f"Final loss: {last['loss']:.6f}, accuracy: {last['accuracy']:.6f}")
    else:
        print(
            f"Nothing left to train: {arguments.checkpoint_dir} holds a finished "
            "run; remove it to start again."
        )
    if arguments.output:
        np.savez(arguments.output, *weights)
        print(f"Final weights written to {arguments.output}")


if __name__ == "__main__":
    main()
