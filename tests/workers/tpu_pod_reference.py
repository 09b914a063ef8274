"""The 1-process x 8-device side of `tests/test_tpu_pod.py`.

`python tpu_pod_reference.py POD_DIR OUTPUT.npz`: trains `examples/tpu_pod.py`
in this one process on the pod's (4, 2) mesh (the reference), then restores
the checkpoint the 4-process pod wrote into a fresh model under another mesh
(8-way `DataParallel`) with `kd.restore`, and saves, as arrays: the
reference's weights (`reference_*`), the pod's final weights file
(`pod_*`), the restored weights (`restored_*`) and the weights before
training (`initial_*`).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import keras
import numpy as np

import keras_dist as kd

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tpu_pod.py"


def main() -> None:
    pod_dir, output = pathlib.Path(sys.argv[1]), sys.argv[2]
    spec = importlib.util.spec_from_file_location("tpu_pod", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # kd.initialize(): one process here
    keras.utils.set_random_seed(0)  # as the script: its weights before training
    initial = example.build_model()
    reference = example.main(
        [
            "--checkpoint-dir",
            str(pod_dir / "reference_checkpoints"),
            "--chips-per-host",
            "2",
            "--epochs",
            "1",
        ]
    )
    pod = example.build_model()
    pod.load_weights(pod_dir / "final.weights.h5")
    distribution = kd.DataParallel()
    with distribution.scope():
        restored = example.build_model()
        restored.build((None, 32))
        step = kd.restore(restored, pod_dir / "checkpoints")
    arrays = {"step": np.array(step)}
    for name, model in (
        ("initial", initial),
        ("reference", reference),
        ("pod", pod),
        ("restored", restored),
    ):
        for index, weight in enumerate(model.get_weights()):
            arrays[f"{name}_{index}"] = weight
    np.savez(output, **arrays)


if __name__ == "__main__":
    main()
