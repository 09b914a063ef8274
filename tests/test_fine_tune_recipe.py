"""The LLM fine-tuning recipe, `examples/fine_tune_llm.py` (docs/fine-tuning.md).

Every command of the page's "Run it" block runs word for word, as a user's
shell would (`tests/doc_commands.py`), with no `--directory`: the default
checkpoint directory must be one every process sees.
PyTorch: `keras-dist launch --nproc-per-node 2` (gloo), a tiny KerasHub Gemma
under FSDP x tensor parallelism on a (1, 2) mesh with `remat="full"` and
bfloat16 compute, `kd.Checkpoint` during `fit`: both processes generate the
same tokens from the trained model and from a fresh one restored onto a (2, 1)
mesh; with `--lora` only the LoRA factors train.
JAX: one process, 8 simulated devices, a (2, 4) mesh restored onto (4, 2).
TensorFlow shards no variables: `--data-parallel` runs the recipe there, and
FSDP with KerasHub's map is refused, naming what runs instead.

KerasHub 0.32 imports on Keras 3.15 only (not on the 3.16 previews): these
tests are skipped, saying so, where `keras_hub` does not import. The LoRA
checkpoint test needs no KerasHub and runs on every backend.
"""

from __future__ import annotations

import argparse
import ast
import os
import pathlib
import re
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.doc_commands import documented_command, run_documented
from tests.multiprocess import once_per_run

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "fine_tune_llm.py"
GENERATED = re.compile(
    r"^(?:\[rank (\d)\] )?generated (by the trained model|after restoring step (\d+)): "
    r"(\[.*\])$"
)
TRAINED = re.compile(r"^(?:\[rank (\d)\] )?trained (\d+) variables: (.*)$")


def _keras_hub_or_skip() -> None:
    try:
        import keras_hub  # noqa: F401, PLC0415
    except Exception as error:  # ImportError, or a Keras it does not support
        pytest.skip(
            f"keras_hub does not import here ({type(error).__name__}: {error}); "
            "KerasHub 0.32 needs Keras 3.15"
        )


def _run_documented(command: str, directory: pathlib.Path) -> str:
    """`command` as the page writes it, from `directory`; its output (both
    streams: the launcher prefixes each rank's lines)."""
    result = run_documented(
        command,
        directory=directory,
        # The default checkpoint directories go in here, not in the machine's.
        env={"TMPDIR": str(_made(directory / "tmp"))},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def _made(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _report(stdout: str) -> dict[int, dict]:
    """Per rank: the tokens generated before and after the restore, the step
    restored and the variables trained."""
    ranks: dict[int, dict] = {}
    for line in stdout.splitlines():
        generated = GENERATED.match(line)
        if generated:
            rank, which, step, tokens = generated.groups()
            entry = ranks.setdefault(int(rank or 0), {})
            key = "trained" if which.startswith("by") else "restored"
            entry[key] = ast.literal_eval(tokens)
            if step is not None:
                entry["step"] = int(step)
        trained = TRAINED.match(line)
        if trained:
            rank, count, paths = trained.groups()
            entry = ranks.setdefault(int(rank or 0), {})
            entry["variables"] = paths.split()
            assert len(entry["variables"]) == int(count)
    return ranks


def _torch_run(tmp_path_factory, command: str, name: str) -> dict[int, dict]:
    _keras_hub_or_skip()
    stdout = once_per_run(
        tmp_path_factory, name, lambda directory: _run_documented(command, directory)
    )
    return _checked_report(stdout, mesh="{'batch': 1, 'model': 2}", ranks=[0, 1])


def _checked_report(stdout: str, mesh: str, ranks: list[int]) -> dict[int, dict]:
    report = _report(stdout)
    assert sorted(report) == ranks, stdout[-3000:]
    for rank in ranks:
        assert report[rank]["step"] == 4, stdout[-3000:]  # the default --steps
        assert report[rank]["restored"] == report[rank]["trained"], stdout
        assert report[rank] == report[0]
    assert f"plan on {mesh}" in stdout
    tokens = np.asarray(report[0]["trained"])
    assert tokens.shape == (4, 12)
    # The prompts are kept and followed by tokens the model chose.
    assert tokens[0, :4].tolist() == [5, 6, 7, 8]
    return report


@pytest.mark.backend("torch")
def test_torch_full_fine_tune_generates_the_same_after_restoring_onto_another_mesh(
    tmp_path_factory,
):
    command = documented_command(
        ".venv/bin/keras-dist launch --nproc-per-node 2 examples/fine_tune_llm.py"
    )
    report = _torch_run(tmp_path_factory, command, "fine_tune_torch_full")
    trained = report[0]["variables"]
    # Every weight trains: 9 per decoder block, the final norm, the embeddings.
    assert len(trained) == 20 and "token_embedding/embeddings" in trained, trained


@pytest.mark.backend("torch")
def test_torch_lora_fine_tune_trains_only_the_lora_factors(tmp_path_factory):
    command = documented_command(
        ".venv/bin/keras-dist launch --nproc-per-node 2 examples/fine_tune_llm.py "
        "--lora"
    )
    report = _torch_run(tmp_path_factory, command, "fine_tune_torch_lora")
    trained = report[0]["variables"]
    # Query and value, factors a and b, in each of the 2 decoder blocks.
    assert len(trained) == 8, trained
    assert all(re.search(r"/(query|value)/lora_kernel_[ab]$", p) for p in trained)


@pytest.mark.backend("torch")
def test_without_directory_several_processes_off_one_launcher_are_refused(
    monkeypatch, capsys
):
    """Under torchrun, SLURM or several hosts no default directory is one
    every process sees: the example stops at once, naming `--directory`."""
    _keras_hub_or_skip()
    fine_tune_llm = _example_module()
    monkeypatch.setattr(fine_tune_llm.kd, "num_processes", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("KERAS_DIST_JOB_DIR", "/job")
    parser = argparse.ArgumentParser()
    found = fine_tune_llm.shared_directory(parser, "fine_tune_llm_full")
    assert found == os.path.join("/job", "fine_tune_llm_full")
    for variable, value in (("LOCAL_WORLD_SIZE", "1"), ("KERAS_DIST_JOB_DIR", "")):
        monkeypatch.setenv(variable, value)
        with pytest.raises(SystemExit) as stopped:
            fine_tune_llm.shared_directory(parser, "fine_tune_llm_full")
        assert stopped.value.code == 2
        said = capsys.readouterr().err
        assert "--directory is needed with 2 processes" in said, said
        assert "Received: no --directory" in said


@pytest.mark.backend("jax")
def test_jax_fine_tune_on_eight_devices_restores_onto_the_other_mesh(tmp_path):
    _keras_hub_or_skip()
    stdout = _run_documented(
        documented_command(
            "KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 .venv/bin/python "
            "examples/fine_tune_llm.py"
        ),
        tmp_path,
    )
    report = _checked_report(stdout, mesh="{'batch': 2, 'model': 4}", ranks=[0])
    assert len(report[0]["variables"]) == 20, report[0]["variables"]


@pytest.mark.backend("tensorflow")
def test_tensorflow_runs_the_recipe_data_parallel(tmp_path):
    _keras_hub_or_skip()
    stdout = _run_documented(
        documented_command(
            "KERAS_BACKEND=tensorflow KERAS_DIST_CPU_DEVICES=4 .venv/bin/python "
            "examples/fine_tune_llm.py --data-parallel"
        ),
        tmp_path,
    )
    report = _checked_report(stdout, mesh="", ranks=[0])
    assert len(report[0]["variables"]) == 20, report[0]["variables"]


def _example_module():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import fine_tune_llm  # noqa: PLC0415
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return fine_tune_llm


@pytest.mark.backend("tensorflow")
def test_tensorflow_refuses_fsdp_with_keras_hub_layouts_naming_what_runs():
    _keras_hub_or_skip()
    fine_tune_llm = _example_module()
    causal_lm = fine_tune_llm.build_causal_lm()
    mesh = kd.DeviceMesh((2, 2), ["batch", "model"], kd.list_devices()[:4])
    with pytest.raises(NotImplementedError, match="remat"):
        fine_tune_llm.fsdp_tp(causal_lm.backbone, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # for_keras_hub's repairs, if any
        layout_map = kd.layouts.for_keras_hub(causal_lm.backbone, mesh)
    inputs, labels, weights = fine_tune_llm.synthetic_tokens(8)
    for distribution in (
        kd.FSDP(layout_map=layout_map, mixed_precision="bfloat16"),
        kd.ModelParallel(layout_map=layout_map),
    ):
        with pytest.raises(NotImplementedError, match="jax and torch"):
            causal_lm.fit(
                inputs,
                labels,
                sample_weight=weights,
                batch_size=8,
                verbose=0,
                callbacks=[kd.DistributeCallback(distribution)],
            )


def _lora_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, name="dense"),
            keras.layers.EinsumDense("ab,bc->ac", 4, name="einsum"),
        ]
    )
    for layer in model.layers:
        layer.enable_lora(2)
    model.compile(optimizer="adam", loss="mse")
    return model


def test_a_lora_model_checkpoints_and_restores_its_factors(tmp_path):
    """Keras saves a LoRA layer's kernel with `a @ b` merged in and not the
    factors; a `kd.Checkpoint` keeps the base kernel and both factors, so a
    restored LoRA model is the trained one, factors included."""
    rng = np.random.default_rng(0)
    x = rng.random((32, 8), dtype="float32")
    y = rng.random((32, 4), dtype="float32")
    model = _lora_model()
    model.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        callbacks=[kd.DistributeCallback(kd.DataParallel()), kd.Checkpoint(tmp_path)],
    )
    restored = _lora_model()
    assert kd.restore(restored, tmp_path) == 4
    paths = [variable.path.split("/", 1)[1] for variable in restored.weights]
    assert "dense/lora_kernel_b" in paths and "einsum/lora_kernel_a" in paths
    for ours, theirs in zip(restored.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert int(np.asarray(restored.optimizer.iterations)) == 4
