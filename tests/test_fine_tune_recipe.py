"""The LLM fine-tuning recipe, `examples/fine_tune_llm.py` (docs/fine-tuning.md).

PyTorch: the script under `keras-dist launch --nproc-per-node 2` (gloo), a
tiny KerasHub Gemma under FSDP x tensor parallelism on a (1, 2) mesh with
`remat="full"` and bfloat16 compute, `kd.Checkpoint` during `fit`: both
processes generate the same tokens from the trained model and from a fresh
one restored onto a (2, 1) mesh; with `--lora` only the LoRA factors train.
Both runs in one job, one after the other, each as its command line runs it
(`tests/workers/run_scripts.py`: one start-up).
TensorFlow shards no variables: `--data-parallel` runs the recipe there, and
FSDP with KerasHub's map is refused, naming what runs instead. On JAX the
page's code blocks run the recipe (tests/test_docs_code_blocks.py).

KerasHub 0.32 imports on Keras 3.15 only (not on the 3.16 previews): these
tests are skipped, saying so, where `keras_hub` does not import. The LoRA
checkpoint test needs no KerasHub and runs on every backend.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shlex
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.multiprocess import RUN_SCRIPTS, once_per_run, runs_of

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


def _environment(backend: str, devices: int | None) -> dict[str, str]:
    # The launcher sets the job's variables; none may leak in from the test run.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DIST")}
    env["KERAS_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if devices is not None:
        env["KERAS_DIST_CPU_DEVICES"] = str(devices)
    return env


def _run(
    command: list[str], env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


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


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """The recipe's two PyTorch runs, full fine-tuning then `--lora`, each as
    its command line runs it, one after the other in one job under
    `keras-dist launch --nproc-per-node 2` (`tests/workers/run_scripts.py`:
    one start-up); each run's report, checked alike."""
    _keras_hub_or_skip()
    command = [sys.executable, "-m", "keras_dist", "launch", "--nproc-per-node", "2"]
    runs = {"full": [], "lora": ["--lora"]}

    def launch(directory: pathlib.Path) -> str:
        scripts = [
            shlex.join(
                [str(EXAMPLE), "--steps", "2", "--directory", str(directory / name)]
                + more
            )
            for name, more in runs.items()
        ]
        result = _run(
            [*command, str(RUN_SCRIPTS), *scripts],
            _environment("torch", None),
            timeout=600,
        )
        return result.stdout

    stdout = once_per_run(tmp_path_factory, "fine_tune_torch", launch)
    outputs = runs_of(stdout)
    assert sorted(outputs) == [0, 1], stdout[-3000:]
    return {name: _checked_report(outputs[index]) for index, name in enumerate(runs)}


def _checked_report(stdout: str) -> dict[int, dict]:
    report = _report(stdout)
    assert sorted(report) == [0, 1], stdout[-3000:]
    for rank in (0, 1):
        assert report[rank]["step"] == 2, stdout[-3000:]
        assert report[rank]["restored"] == report[rank]["trained"], stdout
        assert report[rank] == report[0]
    assert "plan on {'batch': 1, 'model': 2}" in stdout
    tokens = np.asarray(report[0]["trained"])
    assert tokens.shape == (4, 12)
    # The prompts are kept and followed by tokens the model chose.
    assert tokens[0, :4].tolist() == [5, 6, 7, 8]
    return report


@pytest.mark.backend("torch")
def test_torch_full_fine_tune_generates_the_same_after_restoring_onto_another_mesh(
    torch_runs,
):
    trained = torch_runs["full"][0]["variables"]
    # Every weight trains: 9 per decoder block, the final norm, the embeddings.
    assert len(trained) == 20 and "token_embedding/embeddings" in trained, trained


@pytest.mark.backend("torch")
def test_torch_lora_fine_tune_trains_only_the_lora_factors(torch_runs):
    trained = torch_runs["lora"][0]["variables"]
    # Query and value, factors a and b, in each of the 2 decoder blocks.
    assert len(trained) == 8, trained
    assert all(re.search(r"/(query|value)/lora_kernel_[ab]$", p) for p in trained)


@pytest.mark.backend("tensorflow")
def test_tensorflow_runs_the_recipe_data_parallel(tmp_path):
    _keras_hub_or_skip()
    result = _run(
        [
            sys.executable,
            str(EXAMPLE),
            "--data-parallel",
            "--lora",
            "--steps",
            "3",
            "--directory",
            str(tmp_path),
        ],
        _environment("tensorflow", 4),
    )
    report = _report(result.stdout)
    assert report[0]["step"] == 3
    assert report[0]["restored"] == report[0]["trained"], result.stdout
    assert len(report[0]["variables"]) == 8, report[0]["variables"]


@pytest.mark.backend("tensorflow")
def test_tensorflow_refuses_fsdp_with_keras_hub_layouts_naming_what_runs():
    _keras_hub_or_skip()
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import fine_tune_llm  # noqa: PLC0415
    finally:
        sys.path.remove(str(EXAMPLE.parent))
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
