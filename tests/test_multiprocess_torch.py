"""Real multi-process PyTorch jobs: 2 gloo processes on loopback."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.multiprocess import (
    assert_each_input_type_once_per_epoch,
    assert_own_data_parity,
    log_of,
    once_per_run,
    run_job,
    run_job_once,
)

pytestmark = pytest.mark.backend("torch")

TORCH = {"KERAS_BACKEND": "torch"}


# The 2-process runs of the tests below in two jobs, and their one-process
# references in another (each start-up costs seconds: CI's time). The input
# jobs: every input type first, while the processes are still unseeded
# (process 0's random streams must win), the DataLoaders, and last the
# DataLoaders that differ, which end in an error. (Two jobs: the first is
# also the one keras-nightly runs, tests/keras_nightly_tests.txt.)
JOB = "train,train_batch_norm,train_local_batch_norm,unused_weight,own_data"
INPUT_JOB = "every_kind,loaders,loader_mismatch"
REFERENCES = "train,train_batch_norm,unused_weight_reference,own_data_reference,loaders"


@pytest.fixture(scope="module")
def input_job(tmp_path_factory):
    return once_per_run(
        tmp_path_factory,
        "torch_inputs",
        lambda directory: run_job(
            "torch_worker.py", [INPUT_JOB], processes=2, env=TORCH, output_dir=directory
        ),
    )


def test_every_sample_once_per_epoch_across_processes(input_job):
    """Arrays, tf.data, a PyDataset, a DataLoader and a generator."""
    results = [result["every_kind"] for result in input_job]
    assert_each_input_type_once_per_epoch(results, 37)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job_once(
        tmp_path_factory, "torch_two", "torch_worker.py", [JOB], processes=2, env=TORCH
    )


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    (result,) = once_per_run(
        tmp_path_factory,
        "torch_one",
        lambda directory: run_job(
            "torch_worker.py",
            [REFERENCES],
            processes=1,
            env=TORCH,
            output_dir=directory,
        ),
    )
    return result


@pytest.fixture(scope="module")
def two_processes(job):
    results, output_dir = job
    return [result["train"] for result in results], output_dir


@pytest.fixture(scope="module")
def one_process(references):
    return references["train"]


def test_ddp_training_matches_one_process(two_processes, one_process):
    """Ranks started from different seeds; 45 samples in batches of 12."""
    results, _ = two_processes
    assert [r["processes"] for r in results] == [2, 2]
    for result in results:
        for ours, reference in zip(
            result["weights"], one_process["weights"], strict=True
        ):
            np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)


def test_logs_are_global_and_identical_on_every_rank(two_processes, one_process):
    results, _ = two_processes
    for result in results:
        for key, values in one_process["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        for key, value in one_process["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, atol=1e-5)
    assert results[0]["history"] == results[1]["history"]


def test_predict_returns_every_row_in_order_on_every_rank(two_processes, one_process):
    results, _ = two_processes
    for result in results:
        assert len(result["predictions"]) == 45
        np.testing.assert_allclose(
            result["predictions"], one_process["predictions"], atol=1e-5
        )


@pytest.fixture(scope="module")
def cpu_less_jobs(tmp_path_factory):
    """NCCL, the backend `kd.initialize()` starts where CUDA is available,
    refuses CPU tensors; a default group that has gloo for CUDA tensors only
    (`cuda:gloo`) stands in for it on this CPU machine. One job per way of
    averaging the gradients (after backward: CPU's default; DDP: CUDA's)."""
    return {
        sync: run_job_once(
            tmp_path_factory,
            f"torch_cpu_less_{sync}",
            "torch_worker.py",
            ["default_group,train,train_batch_norm,branch_per_process"],
            processes=2,
            env={
                **TORCH,
                "KERAS_DIST_TORCH_BACKEND": "cuda:gloo",
                "KERAS_DIST_TORCH_GRADIENT_SYNC": sync,
            },
        )[0]
        for sync in ("after_backward", "ddp")
    }


def test_cpu_collectives_leave_a_default_group_that_refuses_cpu_tensors(
    cpu_less_jobs, references
):
    """keras_dist's collectives on CPU tensors (metric sums, batch sizes,
    input fingerprints, random streams, barriers) and on the CPU model's
    (the gradients' all-reduce or DDP, synchronized BatchNorm) run on a gloo
    group of the same processes: training, logs, evaluation and predictions
    equal one process'."""
    for result in cpu_less_jobs["after_backward"] + cpu_less_jobs["ddp"]:
        group = result["default_group"]
        assert group["backend"] == "cuda:gloo"
        assert "cpu" in group["cpu_refused"]
        for name in ("train", "train_batch_norm"):
            ours, reference = result[name], references[name]
            for weights, expected in zip(
                ours["weights"], reference["weights"], strict=True
            ):
                np.testing.assert_allclose(weights, expected, atol=1e-5, rtol=0)
            for key, values in reference["history"].items():
                np.testing.assert_allclose(ours["history"][key], values, atol=1e-5)
        np.testing.assert_allclose(
            result["train"]["predictions"],
            references["train"]["predictions"],
            atol=1e-5,
        )
        for key, value in references["train"]["evaluation"].items():
            np.testing.assert_allclose(
                result["train"]["evaluation"][key], value, atol=1e-5
            )


def test_a_weight_only_some_processes_reach_trains_alike_everywhere(cpu_less_jobs):
    """Each process' rows take a different branch, every step: both branches
    train (their gradients averaged with the other process' zeros), every
    process ends with the same weights, the same both ways of averaging."""
    by_sync = {
        sync: [result["branch_per_process"] for result in results]
        for sync, results in cpu_less_jobs.items()
    }
    for results in by_sync.values():
        first, second = results
        for ours, theirs in zip(first["weights"], second["weights"], strict=True):
            np.testing.assert_array_equal(ours, theirs)
        # Process 0's initial weights won; each branch's kernel moved.
        for initial, trained in zip(
            first["initial"][::2], first["weights"][::2], strict=True
        ):
            assert np.abs(np.subtract(initial, trained)).max() > 1e-3
    for ours, theirs in zip(
        by_sync["after_backward"][0]["weights"],
        by_sync["ddp"][0]["weights"],
        strict=True,
    ):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_only_rank_zero_prints(two_processes):
    # Keras' progress bar ("loss: 0.93"); warnings may come from every rank.
    _, output_dir = two_processes
    progress = re.compile(r"\bloss: \d")
    assert progress.search(log_of(output_dir, 0))
    assert not progress.search(log_of(output_dir, 1))


@pytest.fixture(scope="module")
def batch_norm_reference(references):
    """The BatchNormalization model trained in one process."""
    return references["train_batch_norm"]


def test_batch_norm_training_matches_one_process(batch_norm_reference, job):
    """BatchNormalization normalizes over the global batch, padding left out.

    45 samples in batches of 12: the last global batch of 9 rows is split 5 + 4
    (+1 padding row); a Conv1D's BN reduces over rows and positions.
    """
    results = [result["train_batch_norm"] for result in job[0]]
    reference = batch_norm_reference
    # Two BatchNormalization layers: gamma, beta, moving mean and variance each.
    assert len(reference["weights"]) == 14
    for result in results:
        for ours, expected in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        for name, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][name], values, atol=1e-5)
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], atol=1e-5
        )
    for first, second in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_array_equal(first, second)


def test_per_process_batch_norm_statistics_stay_equal_on_every_rank(
    batch_norm_reference, job
):
    """`DataParallel(sync_batch_norm=False)`: each rank normalizes with its own
    rows (like DDP without SyncBatchNorm); the moving statistics are averaged."""
    results = [result["train_local_batch_norm"] for result in job[0]]
    for first, second in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_allclose(first, second, atol=1e-6, rtol=0)
    # Not the one-device statistics: the ranks normalized their own halves.
    differences = [
        np.max(np.abs(np.asarray(ours) - np.asarray(reference)))
        for ours, reference in zip(
            results[0]["weights"], batch_norm_reference["weights"], strict=True
        )
    ]
    assert max(differences) > 1e-3


def test_weights_without_a_gradient_train_as_in_plain_keras(job, references):
    """A head the loss never reaches gets no gradient: DDP alone would never
    all-reduce its bucket (an error or a hang at the next step). 2 processes
    train as plain Keras on one (issue 25, item 12); the head stays as it was
    (AdamW's decay did not reach it: the optimizer skipped it, as Keras')."""
    results = [result["unused_weight"] for result in job[0]]
    reference = references["unused_weight_reference"]
    for result in results:
        for ours, theirs in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(result["loss"], reference["loss"], atol=1e-5)
        assert result["head"] == result["initial_head"]


def test_processes_feeding_their_own_data_train_like_one_process(job, references):
    """auto_shard_dataset=False with 19 and 18 samples per rank."""
    results = [result["own_data"] for result in job[0]]
    assert_own_data_parity(results, references["own_data_reference"])


def _loads_by_epoch(result: dict) -> dict[int, list[list[int]]]:
    """The batches of sample indices a process loaded, per epoch (any order)."""
    epochs: dict[int, list[list[int]]] = {}
    for epoch, indices in result["loads"]:
        epochs.setdefault(epoch, []).append(indices)
    return {epoch: sorted(batches) for epoch, batches in epochs.items()}


def _assert_trains_like_one_process(results: list[dict], reference: dict) -> None:
    for result in results:
        for ours, expected in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        for key, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        for key, value in reference["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, atol=1e-5)
        assert len(result["predictions"]) == 37
        np.testing.assert_allclose(
            result["predictions"], result["expected_predictions"], atol=1e-5
        )
    assert results[0]["history"] == results[1]["history"]


@pytest.fixture(scope="module")
def loader_jobs(input_job, references):
    """fit on a shuffled DataLoader (2 loader workers a process), one with
    drop_last and one over an IterableDataset: in 2 processes and in 1."""
    return [result["loaders"] for result in input_job], references["loaders"]


def _run_loader_job(kind: str, loader_jobs) -> tuple[list[dict], dict]:
    results, reference = loader_jobs
    return [result[kind] for result in results], reference[kind]


@pytest.mark.parametrize("kind", ["shuffled", "drop_last"])
def test_each_process_loads_only_its_rows_of_a_data_loader(kind, loader_jobs):
    """37 samples in global batches of 12: [12, 12, 12, 1], or [12, 12, 12]
    with drop_last; "shuffled" loads through 2 loader workers per process."""
    results, reference = _run_loader_job(kind, loader_jobs)
    _assert_trains_like_one_process(results, reference)
    kept = 37 if kind == "shuffled" else 36
    ours = [_loads_by_epoch(result) for result in results]
    single = _loads_by_epoch(reference)
    assert sorted(single) == [0, 1, 2] and all(sorted(o) == [0, 1, 2] for o in ours)
    for epoch, global_batches in single.items():
        per_process = [[i for batch in loads[epoch] for i in batch] for loads in ours]
        assert not set(per_process[0]) & set(per_process[1]), "no sample on both"
        assert sorted(per_process[0] + per_process[1]) == list(range(kept))
        # Each process loaded its block of the one-process run's global batches:
        # rows [0, 6) and [6, 12) of each, the last single row on process 0.
        expected = [[], []]
        for batch in global_batches:
            share = -(-len(batch) // 2)
            for rank in range(2):
                if batch[rank * share : (rank + 1) * share]:
                    expected[rank].append(batch[rank * share : (rank + 1) * share])
        assert [loads[epoch] for loads in ours] == [sorted(e) for e in expected]
    if kind == "shuffled":
        assert single[0] != single[1] != single[2], "a new order every epoch"
    else:
        assert single[0] == single[1] == [[*range(s, s + 12)] for s in (0, 12, 24)]


def test_a_data_loader_over_an_iterable_dataset_is_read_whole_by_each_process(
    loader_jobs,
):
    """It cannot be split by index: each process loads every sample and keeps
    its rows of each global batch; training still matches one process."""
    results, reference = _run_loader_job("iterable", loader_jobs)
    _assert_trains_like_one_process(results, reference)
    for result in results:
        assert result["loads"] == [[epoch, list(range(37))] for epoch in range(3)]


def test_data_loaders_that_differ_between_processes_are_named(input_job):
    for result in [result["loader_mismatch"] for result in input_job]:
        assert "process 0: 37 samples" in result["error"]
        assert "process 1: 36 samples" in result["error"]


# The launcher ending a job whose rank dies mid-fit, on PyTorch:
# test_fault_lifecycle.py (kill -9 of a rank at a random moment of `fit`, its
# gloo errors named a consequence; a rank raising).


# -- ModelParallel through DTensor ---------------------------------------------
# The 2-process ModelParallel and FSDP runs in one job (each start-up costs
# seconds: CI's time); last the op DTensor cannot run, which ends in errors.
MODEL_PARALLEL_JOB = (
    "model_parallel,model_parallel_fsdp,model_parallel_fsdp_alone,"
    "model_parallel_callbacks,model_parallel_unsupported_op"
)


@pytest.fixture(scope="module")
def model_parallel_job(tmp_path_factory):
    """A (1, 2) mesh, the Dense kernels and the first bias sharded on "model";
    ranks started from different seeds; 45 samples in batches of 12 (and the
    other 2-process runs below); and the same fit in one process with nothing
    sharded."""
    results = once_per_run(
        tmp_path_factory,
        "torch_model_parallel",
        lambda directory: run_job(
            "torch_worker.py",
            [MODEL_PARALLEL_JOB],
            processes=2,
            env=TORCH,
            output_dir=directory,
        ),
    )
    (reference,) = once_per_run(
        tmp_path_factory,
        "torch_model_parallel_reference",
        lambda directory: run_job(
            "torch_worker.py",
            ["model_parallel_reference"],
            processes=1,
            env=TORCH,
            output_dir=directory,
        ),
    )
    return results, reference


@pytest.fixture(scope="module")
def model_parallel(model_parallel_job):
    results, reference = model_parallel_job
    return [result["model_parallel"] for result in results], reference


def test_model_parallel_trains_like_one_process(model_parallel):
    results, reference = model_parallel
    for result in results:
        for ours, expected in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
        for key, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        for key, value in reference["evaluation"].items():
            np.testing.assert_allclose(result["evaluation"][key], value, atol=1e-5)
        assert len(result["predictions"]) == 45
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], atol=1e-5
        )
    assert results[0]["history"] == results[1]["history"]
    # A batch axis of size 1: every process computes on whole batches.
    assert [r["input_rows"] for r in results] == [[12, 12]] * 2
    # The LayoutMap's "dense/output": (None, None) replicated the first layer's
    # column-sharded output before the second layer.
    assert [r["second_layer_input"] for r in results] == [["R", "R"]] * 2
    assert [r["distributed_columns"] for r in results] == [
        [[0, 1], [4, 5]],
        [[2, 3], [6, 7]],
    ]


def test_model_parallel_each_process_holds_half_of_each_sharded_variable(
    model_parallel,
):
    results, reference = model_parallel
    halves = {
        "dense/kernel": ([6, 8], ["R", "S(1)"]),
        "dense/bias": ([8], ["R", "S(0)"]),
        "dense_1/kernel": ([8, 3], ["R", "S(0)"]),
        "dense_1/bias": ([3], ["R", "R"]),  # not in the LayoutMap: replicated
    }
    for result in results:
        held = result["held_in_fit"]
        for path, (kind, shape, placements) in held.items():
            owner = next(
                (k for k in halves if f"_{k.replace('/', '_')}_" in path), None
            )
            if path.startswith("sequential/"):
                assert (kind, [shape, placements]) == (
                    "DTensor",
                    list(halves[path.removeprefix("sequential/")]),
                ), path
            elif owner is not None:  # Adam's moments follow their variable
                assert (kind, [shape, placements]) == ("DTensor", list(halves[owner]))
            else:  # the iteration count and the learning rate
                assert kind == "Parameter" and shape == [], path
        assert sum(path.startswith("adam/") for path in held) == 10
        # get_weights() inside fit gathers full values; after fit the model is
        # an ordinary one holding full tensors.
        assert result["weight_shapes_in_fit"] == [[6, 16], [16], [16, 3], [3]]
        assert {kind for kind, _, _ in result["held_after"].values()} == {"Parameter"}
        np.testing.assert_allclose(
            result["plain_predictions"], reference["predictions"], atol=1e-5
        )
    assert {kind for kind, _, _ in reference["held_in_fit"].values()} == {"Parameter"}


@pytest.mark.parametrize(
    ("scenario", "processes", "expected"),
    [
        # FSDP on 2 processes: every variable that 2 divides is split along
        # "batch" on its largest such dimension; rows split 6 + 6.
        (
            "model_parallel_fsdp",
            2,
            {
                "dense/kernel": ["DTensor", [6, 8], ["S(1)"]],
                "dense/bias": ["DTensor", [8], ["S(0)"]],
                "dense_1/kernel": ["DTensor", [8, 3], ["S(0)"]],
                "dense_1/bias": ["DTensor", [3], ["R"]],
            },
        ),
        # The same with each variable split along its first dimension in
        # collectives of its own (what a variable of 4 MiB or more gets), the
        # others bundled: dense/bias and dense_1/kernel alone, dense/kernel
        # (split along its second dimension) and dense_1/bias (replicated)
        # together.
        (
            "model_parallel_fsdp_alone",
            2,
            {
                "dense/kernel": ["DTensor", [6, 8], ["S(1)"]],
                "dense/bias": ["DTensor", [8], ["S(0)"]],
                "dense_1/kernel": ["DTensor", [8, 3], ["S(0)"]],
                "dense_1/bias": ["DTensor", [3], ["R"]],
            },
        ),
        # FSDP x tensor parallelism on a (2, 2) mesh, 4 processes: the
        # LayoutMap's "model" split is kept and "batch" goes on another
        # dimension where 2 divides it; rows split 6 + 6 along "batch".
        (
            "model_parallel_fsdp_2x2",
            4,
            {
                "dense/kernel": ["DTensor", [3, 8], ["S(0)", "S(1)"]],
                "dense/bias": ["DTensor", [8], ["R", "S(0)"]],
                "dense_1/kernel": ["DTensor", [8, 3], ["R", "S(0)"]],
                "dense_1/bias": ["DTensor", [3], ["R", "R"]],
            },
        ),
    ],
)
def test_fsdp_trains_like_one_process(
    model_parallel_job, tmp_path, scenario, processes, expected
):
    two, reference = model_parallel_job
    if processes == 2:
        results = [result[scenario] for result in two]
    else:
        results = run_job(
            "torch_worker.py",
            [scenario],
            processes=processes,
            env=TORCH,
            output_dir=tmp_path,
        )
    for result in results:
        for ours, theirs in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
        for key, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][key], values, atol=1e-5)
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], atol=1e-5
        )
        held = result["held_in_fit"]
        for path, value in expected.items():
            assert held[f"sequential/{path}"] == value, path
        # Adam's moments follow their variable: half of each split one.
        moments = [v for p, v in held.items() if "dense_kernel_" in p]
        assert moments and all(v == expected["dense/kernel"] for v in moments)
        assert result["input_rows"] == [6, 6]


def test_model_parallel_names_the_op_and_layer_dtensor_cannot_run(
    model_parallel_job,
):
    """A Conv2D sharded on its output channels fails in this torch release."""
    for result in [
        result["model_parallel_unsupported_op"] for result in model_parallel_job[0]
    ]:
        with_bias, kernel_only = result["kernel_and_bias"], result["kernel_only"]
        assert (
            "could not run aten.add.Tensor in layer 'sequential/conv'"
            in (with_bias["error"])
        )
        assert "torch.add" in kernel_only["error"]
        assert "in layer 'sequential_1/conv' (Conv2D)" in kernel_only["error"]
        for case in (with_bias, kernel_only):
            assert "Shard(dim=3)" in case["error"]
            assert case["works_after"] and case["kinds_after"] == ["Parameter"]


def test_model_parallel_callbacks_assign_weights_and_model_errors_keep_their_type(
    model_parallel_job,
):
    """EarlyStopping(restore_best_weights=True) and set_weights() during a
    sharded call, listed before the DistributeCallback, train like one device;
    an error raised by the model's own code is not reported as DTensor's."""
    for result in [
        result["model_parallel_callbacks"] for result in model_parallel_job[0]
    ]:
        assert result["max_difference"] < 1e-5
        assert result["own_error"].startswith("ValueError: the model's own check")
