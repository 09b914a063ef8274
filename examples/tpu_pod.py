"""Training on a Cloud TPU slice of several hosts: one script, every host.

Every host (TPU VM worker) runs this same script. `keras_dist.initialize()`
finds the slice: on a TPU VM started with `gcloud`, JAX asks the VM's metadata
server for the workers and this host's number; on GKE (and in
`tests/test_tpu_pod.py`, 4 processes x 2 CPU devices on loopback) it reads
`TPU_WORKER_HOSTNAMES` and `TPU_WORKER_ID`. The mesh is (hosts, chips a host):
the "model" axis stays within each host's chips (the fast ICI links), the
"batch" axis crosses the hosts, and `kd.FSDP` splits the large weights along
it too. Every host reads the same data; `fit` gives each host its rows of every
global batch (`batch_size` is the global batch). `kd.Checkpoint` writes every
host's shards into one directory, which must be the same path on every host
(a shared file system, or a bucket mounted with Cloud Storage FUSE).

    python examples/tpu_pod.py --checkpoint-dir /mnt/bucket/run  # on every host

See docs/tpu-pods.md for the gcloud commands that start it on every worker.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras_dist as kd  # noqa: E402  (configures simulated devices first)

kd.initialize()  # before any JAX computation: joins every host of the slice

import jax  # noqa: E402  (a TPU slice runs JAX)
import keras  # noqa: E402
import numpy as np  # noqa: E402


def build_model() -> keras.Model:
    """A small MLP; its 64-wide kernels split over the "model" axis."""
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu", name="up"),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="head"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def load_data(samples: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """The same arrays on every host (your data set: every host reads it)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 32)).astype("float32")
    y = (x[:, :10].argmax(axis=1) + (x[:, 10] > 0)) % 10
    return x, y


def make_distribution(model: keras.Model, chips_per_host: int) -> kd.FSDP:
    """A ("batch", "model") mesh: one row of `chips_per_host` chips a model
    replica, rows host by host (`kd.list_devices()` lists process 0's chips
    first, then process 1's...)."""
    devices = kd.list_devices()
    mesh = kd.DeviceMesh(
        (len(devices) // chips_per_host, chips_per_host),
        ["batch", "model"],
        devices=devices,
    )
    # The model axis talks at every layer: keep it on a host's own chips, and
    # let the batch (and FSDP) axis cross the hosts. Checked, as the order of
    # the devices decides it.
    local = {f"{device.platform}:{device.id}" for device in jax.local_devices()}
    for row in np.asarray(mesh.devices).reshape(-1, chips_per_host).tolist():
        if 0 < len(local.intersection(row)) < chips_per_host:
            raise ValueError(
                f"The model axis {row} crosses hosts: this host has only "
                f"{sorted(local.intersection(row))} of it. Make --chips-per-host "
                "divide the chips of one host."
            )
    layout_map = kd.layouts.tensor_parallel(model, mesh)  # kernels on "model"
    return kd.FSDP(layout_map=layout_map)  # and the large ones on "batch" too


def main(argv: list[str] | None = None) -> keras.Model:
    parser = argparse.ArgumentParser(description="training on a TPU slice")
    parser.add_argument("--checkpoint-dir", required=True, help="same on every host")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch")
    parser.add_argument(
        "--chips-per-host",
        type=int,
        default=None,
        help="the model axis' size; default: this host's chips",
    )
    parser.add_argument("--weights", help="also save the final weights there")
    arguments = parser.parse_args(argv)

    keras.utils.set_random_seed(0)  # the same on every host
    x, y = load_data()
    model = build_model()
    chips = arguments.chips_per_host or kd.get_device_count() // kd.num_processes()
    distribution = make_distribution(model, chips)
    print(
        f"host {kd.process_id()} of {kd.num_processes()}: mesh "
        f"{distribution.device_mesh.shape} over {kd.get_device_count()} chips"
    )
    model.fit(
        x,
        y,
        batch_size=arguments.batch_size,  # the global batch, over every host
        epochs=arguments.epochs,
        callbacks=[
            kd.DistributeCallback(distribution),
            kd.Checkpoint(arguments.checkpoint_dir),  # resumes from its newest
        ],
    )
    if arguments.weights:
        # Every host calls it (a weight split over hosts is read collectively);
        # process 0 writes the file.
        model.save_weights(arguments.weights)
    return model


if __name__ == "__main__":
    main()
