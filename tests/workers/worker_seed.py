"""Seed a test process like Keras does, minus TensorFlow on JAX and PyTorch.

`keras.utils.set_random_seed` also seeds TensorFlow whenever it is installed,
which imports it: about 5 s of CPU per process on the 2-core CI machine, and
the multi-process tests start hundreds of JAX and PyTorch processes. On those
backends TensorFlow's global seed changes nothing the tests compare (their
`tf.data` pipelines pass their own seeds), so it is left unset there; Python,
NumPy, torch and Keras' own seeds are set exactly as Keras sets them. The
pytest process itself seeds as Keras does.
"""

from __future__ import annotations

import sys


def set_random_seed(seed: int) -> None:
    import keras  # noqa: PLC0415  (after the worker has set up its backend)

    if (
        keras.backend.backend() == "tensorflow"
        or "tensorflow" in sys.modules
        or "pytest" in sys.modules  # the test process itself uses TensorFlow
    ):
        keras.utils.set_random_seed(seed)
        return
    # In a worker process: a None entry makes `import tensorflow` raise
    # ImportError for this call, so Keras skips seeding it. Keras then answers
    # False to its own `tensorflow.available` checks for the rest of the
    # process (e.g. `keras.distribution`'s own `distribute_dataset`): a worker
    # that needs those imports TensorFlow before seeding. `tf.data` itself
    # still imports TensorFlow when used.
    sys.modules["tensorflow"] = None
    try:
        keras.utils.set_random_seed(seed)
    finally:
        del sys.modules["tensorflow"]
