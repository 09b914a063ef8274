"""PyTorch data parallel (DDP) through a plain `model.fit`.

A small convnet (convolutions without bias, each followed by batch
normalization, then dense layers with dropout) learns scikit-learn's 8x8
handwritten digits (no download). Every process of the job runs this same
script; `keras_dist.DataParallel` splits every global batch between the
processes for the duration of each `fit`/`evaluate` and averages the
gradients: on GPUs through torch's `DistributedDataParallel` (nccl), on CPU
in one all-reduce after the backward pass (gloo). Process 0 shows the
progress; at the end every process prints the test accuracy and a checksum of
its weights, which agree.

The step runs eagerly: with `jit_compile=True` this convnet does not compile
on torch 2.13, plain Keras on one process included (Inductor fails on the
convolutions' backward, "ValueRangeError: Invalid ranges [0:-1]"). A model
that compiles (the MLP of `benchmarks/entries/torch_ddp_mlp.py`) runs its
step on two CPU processes in 0.80 of the eager time, after about 9 s of
compiling.

    keras-dist launch --nproc-per-node 2 examples/torch_ddp_convnet.py
    keras-dist launch --nproc-per-node 2 examples/torch_ddp_convnet.py --epochs 3

`--batch-size` is the global batch: with 2 processes each one computes on half
of it. `KERAS_BACKEND` defaults to `torch` here.
"""

from __future__ import annotations

import argparse
import hashlib
import os

# Must be set before Keras starts its backend.
os.environ.setdefault("KERAS_BACKEND", "torch")

import keras_dist as kd  # noqa: E402

kd.initialize()  # joins the job the launcher (or torchrun, SLURM) describes

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    """Digits as (N, 8, 8, 1) float32 in [0, 1]; 80 % train, 20 % test."""
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    return train_test_split(
        images,
        digits.target.astype("int64"),
        test_size=0.2,
        random_state=seed,
        stratify=digits.target,
    )


def conv_block(x, filters: int, kernel_size: int, strides: int = 1, name=None):
    x = keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False, name=name
    )(x)
    # momentum 0.9: the moving statistics settle within a few epochs of this
    # small data set (Keras' default 0.99 needs hundreds of steps).
    x = keras.layers.BatchNormalization(center=True, scale=False, momentum=0.9)(x)
    return keras.layers.ReLU()(x)


def build_model() -> keras.Model:
    inputs = keras.Input((8, 8, 1))
    x = conv_block(inputs, 16, 3)
    x = conv_block(x, 32, 3, strides=2)  # 4x4
    x = conv_block(x, 64, 3, strides=2, name="wide")  # 2x2
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    x = keras.layers.Dropout(0.3)(x)
    outputs = keras.layers.Dense(10)(x)  # logits
    model = keras.Model(inputs, outputs, name="digits_ddp_convnet")
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def weight_checksum(model: keras.Model) -> str:
    """The sum of absolute weights, and a digest of their exact bytes."""
    weights = model.get_weights()
    digest = hashlib.sha256()
    for weight in weights:
        digest.update(np.ascontiguousarray(weight).tobytes())
    total = float(sum(np.abs(weight).astype("float64").sum() for weight in weights))
    return f"{total:.6f} (sha256 {digest.hexdigest()[:16]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()

    # The same seed everywhere: the same data order on every process. The
    # initial weights need not agree; process 0's are broadcast when fit starts.
    keras.utils.set_random_seed(arguments.seed)
    x_train, x_test, y_train, y_test = load_data(arguments.seed)

    distribution = kd.DataParallel()  # one device per process of the job
    if kd.process_id() == 0:
        print(f"Backend:   {keras.backend.backend()}")
        print(f"Processes: {kd.num_processes()}, devices {kd.list_devices()}")
        print(
            f"Data:      {len(x_train)} training and {len(x_test)} test images, "
            f"global batch {arguments.batch_size} "
            f"({arguments.batch_size // kd.num_processes()} per process)"
        )

    model = build_model()
    model.fit(
        x_train,
        y_train,
        batch_size=arguments.batch_size,
        epochs=arguments.epochs,
        validation_data=(x_test, y_test),
        callbacks=[kd.DistributeCallback(distribution)],
        verbose=2,  # one line per epoch; only process 0 prints it
    )
    results = model.evaluate(
        x_test,
        y_test,
        batch_size=arguments.batch_size,
        verbose=0,
        return_dict=True,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    # Every process prints this: the same accuracy and the same weights.
    print(
        f"process {kd.process_id()}: final test accuracy {results['accuracy']:.4f}, "
        f"weight checksum {weight_checksum(model)}"
    )
    close_process_group()


def close_process_group() -> None:
    """Leave the torch process group before the interpreter shuts down.

    Without this, gloo's worker threads can abort the shutdown now and then
    ("terminate called without an active exception", exit status 134) after
    everything has run; torch asks every program to call
    `destroy_process_group()` at the end. keras_dist does not do it for you yet.
    """
    if keras.backend.backend() != "torch":
        return
    import torch.distributed  # noqa: PLC0415  (torch only when it is the backend)

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
