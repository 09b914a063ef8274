"""keras_dist against plain Keras on one GPU, in one run: the ratio of their
step times (kd / plain; 1.0 is no overhead).

- `--backend jax`: an MLP in float32 (4 x `Dense(4096)`, batch 512) and a
  decoder in `mixed_bfloat16` (8 blocks of `MultiHeadAttention` and an MLP,
  width 1024, 512 tokens), each under `kd.DataParallel()` on the GPU's mesh
  of one device;
- `--backend torch`: the same MLP, one process (no process group).

Plain Keras and keras_dist fit alternately (`--repeats` rounds of one epoch
each, after a warm-up epoch each that compiles); each round's step time is
its epoch's time over its steps, and the ratio is of the medians. One JSON
object on stdout and in `--json`.

    KERAS_BACKEND=jax python benchmarks/gpu_speed.py --json jax_speed.json
    KERAS_BACKEND=torch python benchmarks/gpu_speed.py --json torch_speed.json

`--smoke` shrinks every model and round for a check of the script on a CPU
(its figures then say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _mlp(width: int, dtype: str):
    import keras  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu", dtype=dtype) for _ in range(4)]
        + [keras.layers.Dense(10, dtype="float32")]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _decoder(width: int, blocks: int, tokens: int, vocabulary: int):
    import keras  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    inputs = keras.Input((tokens,), dtype="int32")
    hidden = keras.layers.Embedding(vocabulary, width, dtype="mixed_bfloat16")(inputs)
    heads = max(1, width // 128)
    for _ in range(blocks):
        normed = keras.layers.LayerNormalization(dtype="mixed_bfloat16")(hidden)
        attended = keras.layers.MultiHeadAttention(
            heads, width // heads, dtype="mixed_bfloat16"
        )(normed, normed, use_causal_mask=True)
        hidden = hidden + attended
        normed = keras.layers.LayerNormalization(dtype="mixed_bfloat16")(hidden)
        up = keras.layers.Dense(4 * width, activation="gelu", dtype="mixed_bfloat16")
        down = keras.layers.Dense(width, dtype="mixed_bfloat16")
        hidden = hidden + down(up(normed))
    logits = keras.layers.Dense(vocabulary, dtype="float32")(hidden)
    model = keras.Model(inputs, logits)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _ratio(build, x, y, batch: int, repeats: int) -> dict[str, Any]:
    """Plain Keras and keras_dist alternately, each on its own model."""
    import keras_dist as kd  # noqa: PLC0415
    from benchmarks.harness import EpochTimer  # noqa: PLC0415 (imports keras)

    steps = len(x) // batch
    runs = {"plain": (build(), lambda: []), "kd": (build(), None)}
    distribution = kd.DataParallel()
    runs["kd"] = (runs["kd"][0], lambda: [kd.DistributeCallback(distribution)])
    seconds: dict[str, list[float]] = {"plain": [], "kd": []}
    for round_ in range(repeats + 1):
        for name, (model, callbacks) in runs.items():
            times = EpochTimer()
            model.fit(
                x,
                y,
                batch_size=batch,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[*callbacks(), times],
            )
            if round_:  # the first round compiles
                seconds[name].append(times.seconds[0] / steps)
    plain = statistics.median(seconds["plain"])
    ours = statistics.median(seconds["kd"])
    return {
        "plain_ms_per_step": 1e3 * plain,
        "kd_ms_per_step": 1e3 * ours,
        "ratio": ours / plain,
        "rounds": repeats,
        "steps_per_round": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from keras_dist.backends import get_adapter  # noqa: PLC0415

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    width, batch, steps = (64, 16, 4) if args.smoke else (4096, 512, 40)
    out: dict[str, Any] = {
        "backend": backend,
        "device_kind": get_adapter().device_kind(),
        "keras": keras.__version__,
        "smoke": args.smoke,
    }
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.integers(0, 10, batch * steps).astype("int32")
    if backend == "jax":
        import jax  # noqa: PLC0415

        out["jax"] = jax.__version__
    else:
        import torch  # noqa: PLC0415

        out["torch"] = torch.__version__
    out["mlp_float32"] = _ratio(
        lambda: _mlp(width, "float32"), x, y, batch, args.repeats
    )
    if backend == "jax":
        width, blocks, tokens, vocabulary, batch, steps = (
            (32, 1, 16, 64, 4, 3) if args.smoke else (1024, 8, 512, 32000, 16, 20)
        )
        ids = rng.integers(0, vocabulary, (batch * steps, tokens + 1)).astype("int32")
        out["transformer_bfloat16"] = _ratio(
            lambda: _decoder(width, blocks, tokens, vocabulary),
            ids[:, :-1],
            ids[:, 1:],
            batch,
            args.repeats,
        )
    text = json.dumps(out, indent=1)
    print(text, flush=True)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
