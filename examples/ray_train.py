"""Ray Train: train with keras_dist on the workers of a Ray cluster.

Trains a small classifier on the 8x8 handwritten digits that scikit-learn
ships (no download) with `--workers` Ray Train workers (default 2) started by
`keras_dist_ray.KerasTrainer`, on a local Ray cluster this script starts (or
an existing one, `--address`). Each worker runs `train_fn`, whose body is the
one a `keras-dist launch` script has: `kd.initialize()` (which finds the job
from Ray Train's worker context), then `model.fit` with
`kd.DistributeCallback(kd.DataParallel())`, a `kd.Checkpoint` and
`keras_dist_ray.ReportCallback`, which reports each epoch's global metrics and
the checkpoints to Ray. A worker that dies makes Ray start the group again
(`--max-failures`), and `fit` resumes from the latest checkpoint.

    python examples/ray_train.py                        # JAX
    python examples/ray_train.py --backend torch
    python examples/ray_train.py --backend tensorflow --epochs 3
    python examples/ray_train.py --address auto         # a running Ray cluster

Needs `pip install "keras-dist[ray,examples]"` and the backend. Checkpoints go
to `--checkpoint-dir` (every worker must see it: a shared file system on a
cluster of several nodes); Ray keeps its copies of the reported checkpoints in
the run's directory, `<--storage-path>/keras_dist_digits` (Ray's default
storage: ~/ray_results). Run again, the script resumes the finished run and
trains nothing more: remove both directories to start again. On CPUs, JAX
and TensorFlow workers simulate `KERAS_DIST_CPU_DEVICES` (default 2) CPU
devices each.
"""

from __future__ import annotations

import argparse
import os


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=["jax", "torch", "tensorflow"],
        default=os.environ.get("KERAS_BACKEND", "jax"),
        help="Keras backend of the workers (default: KERAS_BACKEND, else jax)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--max-failures", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default="ray_train_checkpoints")
    parser.add_argument("--storage-path", default=None, help="Ray's run storage")
    parser.add_argument(
        "--address", default=None, help="a Ray cluster to join (e.g. 'auto')"
    )
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    return parser.parse_args()


def train_fn(config: dict) -> None:
    """What every Ray Train worker runs: a keras_dist training script's body."""
    import keras  # noqa: PLC0415 (imported on the worker, after KERAS_BACKEND)
    from keras_dist_ray import ReportCallback  # noqa: PLC0415
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    import keras_dist as kd  # noqa: PLC0415

    kd.initialize()  # rank, size and coordinator from Ray Train
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype("float32"),
        digits.target,
        test_size=0.2,
        random_state=0,
        stratify=digits.target,
    )
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    checkpoint = kd.Checkpoint(config["checkpoint_dir"], save_freq="epoch")
    model.fit(
        x_train,
        y_train,
        batch_size=config["batch_size"],
        epochs=config["epochs"],
        validation_data=(x_test, y_test),
        verbose=2 if kd.process_id() == 0 else 0,
        callbacks=[
            kd.DistributeCallback(kd.DataParallel()),
            checkpoint,
            ReportCallback(checkpoint),  # after the checkpoint it reports
        ],
    )


def main() -> None:
    arguments = parse_arguments()
    # Before Keras starts anywhere: KerasTrainer gives it to every worker.
    os.environ["KERAS_BACKEND"] = arguments.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import ray  # noqa: PLC0415
    from keras_dist_ray import KerasTrainer  # noqa: PLC0415
    from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: PLC0415

    ray.init(address=arguments.address)
    worker_env = {}
    if arguments.backend != "torch" and not arguments.gpu:  # PyTorch: one a process
        worker_env["KERAS_DIST_CPU_DEVICES"] = os.environ.get(
            "KERAS_DIST_CPU_DEVICES", "2"
        )
    trainer = KerasTrainer(
        train_fn,
        train_loop_config={
            "epochs": arguments.epochs,
            "batch_size": arguments.batch_size,
            # The workers' working directory is Ray's: an absolute path.
            "checkpoint_dir": os.path.abspath(arguments.checkpoint_dir),
        },
        scaling_config=ScalingConfig(
            num_workers=arguments.workers, use_gpu=arguments.gpu
        ),
        run_config=RunConfig(
            name="keras_dist_digits",
            storage_path=(
                os.path.abspath(arguments.storage_path)
                if arguments.storage_path
                else None
            ),
            failure_config=FailureConfig(max_failures=arguments.max_failures),
            worker_runtime_env={"env_vars": worker_env},
        ),
    )
    result = trainer.fit()
    print(f"Backend: {arguments.backend}, {arguments.workers} Ray Train workers")
    if result.metrics is None:
        print(
            f"Nothing was trained: {arguments.checkpoint_dir} holds a finished "
            "run; remove it to start again."
        )
        return
    metrics = result.metrics
    print(
        f"Final epoch: loss {metrics['loss']:.4f}, accuracy "
        f"{metrics['accuracy']:.4f}, validation accuracy "
        f"{metrics['val_accuracy']:.4f}"
    )
    print(f"Ray's copy of the last checkpoint: {result.checkpoint.path}")
    print("Load it with: kd.restore(model, d) after result.checkpoint.to_directory(d)")


if __name__ == "__main__":
    main()
