"""A full fine-tune (every weight trained) of a `GemmaCausalLM` of Gemma-2B's
shape (random weights, from its config) under `kd.DataParallel(offload=...)`
on one accelerator, or with `--plain` the same fit in plain Keras: tokens/s
and MFU (model FLOPs from `keras_dist.flops` over the device's bfloat16 peak
in `keras_dist.common.accelerators`: 197 TFLOP/s on a TPU v5e, 989 on an
H200). One JSON line (`RESULT {...}`, also written to `--json`); an
out-of-memory is reported in it, not raised.

```shell
export KERAS_BACKEND=jax
python benchmarks/gemma_full_finetune.py --offload optimizer --steps 3
python benchmarks/gemma_full_finetune.py --offload optimizer --remat full
# One H200 (141 GB): every weight and AdamW's state on the GPU, kd and plain.
python benchmarks/gemma_full_finetune.py --offload none --dtype mixed_bfloat16 --batch 8
python benchmarks/gemma_full_finetune.py --plain --dtype mixed_bfloat16 --batch 8
```

It calls `keras.Model.fit` on the causal LM (no preprocessor: the inputs are
token ids), which skips KerasHub's own input conversion (that one needs Grain
or TensorFlow for NumPy inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import keras
    import keras_hub
    import numpy as np

    import keras_dist as kd
    from keras_dist.common.accelerators import peak_flops_per_device

    out: dict[str, Any] = {"config": vars(args)}
    device = jax.devices()[0]
    out["device_kind"] = device.device_kind
    peak = peak_flops_per_device(device.device_kind, "bfloat16")
    keras.utils.set_random_seed(0)
    shape = dict(
        vocabulary_size=256000,
        num_layers=args.layers,
        num_query_heads=8,
        num_key_value_heads=1,
        hidden_dim=2048,
        intermediate_dim=32768,
        head_dim=256,
    )
    if args.smoke:  # a check of the script on a CPU, not Gemma 2B
        shape.update(
            vocabulary_size=512, hidden_dim=64, intermediate_dim=128, head_dim=8
        )
    backbone = keras_hub.models.GemmaBackbone(**shape, dtype=args.dtype)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    rows = args.batch * args.steps
    tokens = rng.integers(0, shape["vocabulary_size"], (rows, args.sequence + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((rows, args.sequence), "int32"),
    }
    y = tokens[:, 1:].astype("int32")
    options: dict[str, Any] = {}
    if args.offload != "none":
        options["offload"] = args.offload
    if args.remat != "none":
        options["remat"] = args.remat
    if args.state_dtype != "none":
        options["optimizer_state_dtype"] = args.state_dtype

    class Watch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            out.setdefault("epoch_s", []).append(time.perf_counter() - self.start)
            out.setdefault("loss", []).append(float(logs["loss"]))

    callbacks: list[Any] = [Watch()]
    if not args.plain:
        callbacks.insert(0, kd.DistributeCallback(kd.DataParallel(**options)))
    keras.Model.fit(
        model,
        x,
        y,
        batch_size=args.batch,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    step = min(out["epoch_s"][1:] or out["epoch_s"]) / args.steps
    flops = kd.flops.count_flops(
        model, batch_size=args.batch, tokens_per_sample=args.sequence
    )
    out["params"] = int(model.count_params())
    out["ms_per_step"] = 1000 * step
    out["tokens_per_s"] = args.batch * args.sequence / step
    out["peak_tflops"] = None if peak is None else peak / 1e12
    out["mfu"] = None if peak is None else 3 * flops.forward / step / peak
    stats = device.memory_stats() or {}
    out["peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    return out


def main() -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--offload", default="optimizer")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--state-dtype", default="none")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--plain", action="store_true", help="plain Keras: no keras_dist callback"
    )
    parser.add_argument("--json", help="also write the result there")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny model: checks the script"
    )
    args = parser.parse_args()
    try:
        out = run(args)
        out["ok"] = True
    except Exception as error:  # an out-of-memory is a result here
        out = {"config": vars(args), "ok": False}
        out["error"] = f"{type(error).__name__}: {str(error)[:800]}"
    print("RESULT " + json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(out, file, indent=1)


if __name__ == "__main__":
    main()
