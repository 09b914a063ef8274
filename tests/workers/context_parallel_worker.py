"""One process of a multi-process context-parallelism job (2 processes x 4
CPU devices); `tests/test_context_parallel.py` starts it.

Usage: python context_parallel_worker.py CASE[,CASE...] OUTPUT_JSON
Each CASE is `<policy>_<batch>x<seq>` (`data_parallel_2x4`, `fsdp_1x8`): the
decoder of `context_parallel_models` trained and predicted under
that policy with `sequence_axis="seq"` on a `("batch", "seq")` mesh of every
device of the job (devices in process order: a seq axis of 8 spans both
processes); `own_data_1x8`: a `fit` where each process reads its own rows
(`auto_shard_dataset=False`) on that mesh, and the error it raises. Writes what
each case gave, by case.
"""

from __future__ import annotations

import json
import sys

import keras_dist as kd

kd.initialize()

import context_parallel_models as models  # noqa: E402


def distribution(case: str) -> kd.Distribution:
    policy, shape = case.rsplit("_", 1)
    mesh = kd.DeviceMesh(tuple(int(n) for n in shape.split("x")), ["batch", "seq"])
    if policy == "data_parallel":
        return kd.DataParallel(mesh, sequence_axis="seq")
    if policy == "fsdp":
        return kd.FSDP(mesh, min_size=16, sequence_axis="seq")
    if policy == "own_data":
        return kd.DataParallel(mesh, auto_shard_dataset=False, sequence_axis="seq")
    raise ValueError(f"Unknown policy {policy!r} in case {case!r}")


def main() -> None:
    cases, output = sys.argv[1].split(","), sys.argv[2]
    result = {}
    for case in cases:
        if case.startswith("own_data"):
            try:
                models.run(
                    models.decoder(), [kd.DistributeCallback(distribution(case))]
                )
            except ValueError as error:
                result[case] = {"error": str(error)}
            else:
                result[case] = {"error": None}
            continue
        # `fit`, then `predict` (each process gets every row, in order);
        # `evaluate`'s metrics cross the processes as `fit`'s logged ones do.
        model = models.decoder()
        callback = kd.DistributeCallback(distribution(case))
        ran = models.run(model, [callback], fit_only=True)
        x, _, _ = models.data()
        predicted = model.predict(
            x, batch_size=models.BATCH, verbose=0, callbacks=[callback]
        )
        result[case] = {
            "weights": [weight.tolist() for weight in ran["weights"]],
            "history": ran["history"],
            "predict": predicted.tolist(),
        }
    result["processes"] = kd.num_processes()
    result["devices"] = len(kd.list_devices())
    with open(output, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
