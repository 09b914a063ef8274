"""The `keras-dist` command (issue 25): help and `env` start without a
backend, errors say the flags, `plan` refuses what it cannot see.

`plan` runs in this process through `keras_dist.cli.main` (what `python -m
keras_dist` exits with), on every backend: its meshes need no devices.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
import warnings

import pytest

from keras_dist import cli, cli_plan

# The same under every backend: run once (tests/conftest.py).
pytestmark = pytest.mark.backend_neutral

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN = ["plan", "--mesh", "1", "--axes", "batch"]


@pytest.fixture
def run(monkeypatch, capsys):
    """`keras-dist ARGS` in this process: (exit status, stdout, stderr); a
    usage error's SystemExit is its status."""
    monkeypatch.chdir(ROOT)  # MODULE:FUNCTION imports from here, as in a shell

    def run_cli(*arguments: str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # for_keras_hub's repairs
                status = cli.main(list(arguments))
        except SystemExit as exit_:
            status = exit_.code
        out, err = capsys.readouterr()
        return status, out, err

    return run_cli


def test_help_and_env_start_without_a_backend():
    """Measured (2 shared cores): 0.06-0.08 s each, against 8-12 s and six
    TensorFlow log lines on 4aa2b83, which imported Keras and the backend."""
    code = (
        "import sys, time\n"
        "start = time.perf_counter()\n"
        "from keras_dist import cli\n"
        "for arguments in (['--help'], ['plan', '--help'], ['launch', '--help'],"
        " ['env', '--json']):\n"
        "    try:\n"
        "        cli.main(arguments)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('keras', 'jax', 'torch', 'tensorflow', 'numpy')\n"
        "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n"
    )
    # Simulated devices start the backend at import, by design: a user's
    # shell does not set them.
    environment = {
        k: v for k, v in os.environ.items() if k not in ("KERAS_DIST_CPU_DEVICES",)
    }
    environment.pop("TF_CPP_MIN_LOG_LEVEL", None)  # TensorFlow would print
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        cwd=ROOT,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"
    assert "usage: keras-dist plan" in done.stdout
    assert done.stderr == ""  # no backend log lines
    assert elapsed < 30, f"help and env took {elapsed:.1f} s"


def test_plan_refuses_an_unbuilt_model_naming_the_flag(run):
    status, out, err = run(
        *PLAN, "tests.workers.plan_models:unbuilt_mlp", "--device-memory", "1MiB"
    )
    assert status == 1
    assert "No problems found" not in out
    assert "'unbuilt' (Sequential) that tests.workers.plan_models:unbuilt_mlp" in err
    assert "is not built" in err and "--input-shape 1024" in err
    assert "input_shape" not in err
    # Built from --input-shape: two Dense(4096) do not fit 1 MiB.
    status, out, err = run(
        *PLAN,
        "tests.workers.plan_models:unbuilt_mlp",
        "--device-memory",
        "1MiB",
        "--input-shape",
        "4096",
        "--json",
    )
    assert status == 1, err
    report = json.loads(out.strip().splitlines()[-1])
    assert [p["kind"] for p in report["problems"]] == ["out-of-memory"]
    assert report["devices"][0]["parameters"] == 4 * 2 * (4096 * 4096 + 4096)


def test_plan_refuses_an_uncompiled_model_in_the_commands_words(run):
    """The library's error speaks Python (`model.compile(optimizer=...)`,
    `steps=('predict',)`); the command's says what to do in the model file
    and with its flags."""
    topology = ["--topology", "cpu:8", "--batch-size", "8"]
    status, _, err = run("plan", "tests.workers.plan_models:mlp", *topology)
    assert status == 1
    assert (
        "keras-dist plan: the model 'mlp' that tests.workers.plan_models:mlp returns "
        "is not compiled, and the train and test steps compiled for --topology need "
        "its loss and optimizer: the model file's function must compile it (call "
        "model.compile(optimizer=..., loss=...) before returning it), or compile "
        "only prediction with --steps predict." in err
    )
    assert "--optimizer ..." not in err and "('predict',)" not in err
    status, _, err = run(
        "plan", "tests.workers.plan_models:mlp_without_loss", *topology, "--search"
    )
    assert status == 1
    assert (
        "keras-dist plan --search: the model 'mlp' that "
        "tests.workers.plan_models:mlp_without_loss returns was compiled without a "
        "loss, and the train step --search compiles needs one: the model file's "
        "function must give its model.compile a loss. Received:" in err
    )
    assert "--steps" not in err  # --search compiles the train step only


def test_plan_with_a_topology_runs_on_jax_whatever_keras_json_says(tmp_path):
    """`keras-dist plan --topology` as the docs write it, in a venv where Keras'
    default backend is TensorFlow: the command picks JAX; a backend set
    explicitly is refused with what to set."""
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "tensorflow"}))
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KERAS_BACKEND", "KERAS_DIST_CPU_DEVICES")
    }
    environment["KERAS_HOME"] = str(tmp_path)
    command = [
        sys.executable,
        "-m",
        "keras_dist",
        "plan",
        "tests.workers.plan_models:compiled_mlp",
        "--topology",
        "cpu:1",
        "--batch-size",
        "8",
        "--json",
    ]
    for extra in (["--steps", "predict"], ["--search", "--time-budget", "0.001"]):
        done = subprocess.run(
            command + extra,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=environment,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        first = report["results"][0] if "--search" in extra else report
        assert first["compiled"]["devices"] == 1  # compiled by XLA, on JAX
        if "--search" not in extra:  # the compiled plan's notes say flags too
            assert any(
                "pass --device-memory to know whether it fits" in note
                for note in report["compiled"]["notes"]
            )
    refused = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**environment, "KERAS_BACKEND": "tensorflow"},
    )
    assert refused.returncode == 1
    assert "--topology compiles fit's steps with XLA, on the JAX backend" in (
        refused.stderr
    )
    assert "KERAS_BACKEND=tensorflow is set: run it with KERAS_BACKEND=jax" in (
        refused.stderr
    )


def test_plan_with_a_topology_without_jax_installed_says_so(monkeypatch):
    arguments = argparse.Namespace(topology="cpu:8", search=False)
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.delitem(sys.modules, "keras")  # as in a fresh command
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    said = cli_plan.choose_backend(arguments)
    assert "--topology compiles fit's steps with XLA and needs JAX, which is " in said
    assert "not installed: pip install jax" in said
    assert os.environ.get("KERAS_BACKEND") is None
    monkeypatch.undo()
    # JAX installed, nothing set: the command sets JAX; no topology: nothing.
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.delitem(sys.modules, "keras")
    assert cli_plan.choose_backend(arguments) is None
    assert os.environ["KERAS_BACKEND"] == "jax"
    monkeypatch.delenv("KERAS_BACKEND")
    plain = argparse.Namespace(topology=None, search=False)
    assert cli_plan.choose_backend(plain) is None
    assert os.environ.get("KERAS_BACKEND") is None
    monkeypatch.undo()
    # Keras started on another backend already (KERAS_DIST_CPU_DEVICES
    # starts it at import): too late to pick, said with what to set.
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    keras = sys.modules["keras"]
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    said = cli_plan.choose_backend(argparse.Namespace(topology=None, search=True))
    assert "--search compiles fit's steps with XLA, on the JAX backend; Keras " in said
    assert "started on its default backend, tensorflow" in said
    assert said.endswith("run it with KERAS_BACKEND=jax.")


def test_plan_keras_hub_llama_clean_with_for_keras_hub_sized_by_sequence(run):
    pytest.importorskip("keras_hub")
    command = [
        "plan",
        "tests.workers.plan_models:llama",
        "--mesh",
        "2,4",
        "--axes",
        "batch,model",
        "--fsdp",
        "--batch-size",
        "8",
        "--sequence-length",
        "128",
        "--json",
    ]
    status, out, err = run(
        *command, "--layout-map", "tests.workers.plan_models:llama_keras_hub_layout"
    )
    assert status == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["problems"] == []
    # (8, 128) int32 inputs, four (8, 128, 16) float32 outputs, over 2 rows.
    expected = (2 * 8 * 128 * 4 + 4 * 8 * 128 * 16 * 4) // 2
    assert report["devices"][0]["activations"] == expected
    # KerasHub's own map is swapped (keras-hub#2827): reported, exit 1.
    status, out, err = run(
        *command, "--layout-map", "tests.workers.plan_models:llama_own_layout"
    )
    assert status == 1
    assert "6 problem(s): swapped-axes" in err


def test_plan_errors_say_the_flags(run):
    # 256 columns do not split 3 ways: the refusal says the flag to pass.
    status, _, err = run(
        "plan",
        "tests.workers.plan_models:mlp",
        "--mesh",
        "1,3",
        "--axes",
        "batch,model",
        "--layout-map",
        "tests.workers.plan_models:mlp_clean_layout_map",
    )
    assert status == 1
    assert "pass --on-indivisible replicate to plan them replicated" in err
    assert "on_indivisible" not in err
    status, _, err = run(
        *PLAN, "tests.workers.plan_models:llama", "--sequence-length", "0"
    )
    assert status == 1
    assert (
        "`--sequence-length` must be at least 1. Received: --sequence-length 0" in err
    )
    status, _, err = run(*PLAN, "tests.workers.plan_models:mlp", "--input-shape", "x")
    assert status == 2
    assert "--input-shape takes the shape of one sample" in err
    status, _, err = run(
        *PLAN,
        "tests.workers.plan_models:mlp",
        "--input-shape",
        "8",
        "--input-shape",
        "a=8",
    )
    assert status == 2
    assert "--input-shape takes one SHAPE, or NAME=SHAPE once per input" in err
    status, _, err = run(
        "plan", "tests.workers.plan_models:mlp", "--mesh", "2x4", "--axes", "a"
    )
    assert status == 2
    assert "--mesh takes sizes such as 2,4. Received: --mesh '2x4'" in err
    # NAME=SHAPE for each input of a KerasHub backbone.
    pytest.importorskip("keras_hub")
    status, out, err = run(
        *PLAN,
        "tests.workers.plan_models:llama",
        "--batch-size",
        "2",
        "--input-shape",
        "token_ids=8",
        "--input-shape",
        "padding_mask=8",
        "--json",
    )
    assert status == 0, err
    activations = json.loads(out.strip().splitlines()[-1])["devices"][0]["activations"]
    assert activations == 2 * (2 * 8 * 4) + 4 * (2 * 8 * 16 * 4)
    status, _, err = run(
        "plan", "tests.workers.plan_models:mlp", "--mesh", "2,4", "--axes", "batch"
    )
    assert status == 2
    assert "--axes takes one distinct name per size of --mesh" in err
    status, out, _ = run(*PLAN, "tests.workers.plan_models:mlp")
    assert status == 0
    assert "pass --batch-size for one" in out and "batch_size=" not in out


def test_launch_errors_say_the_flags(run, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    cases = [
        (
            ["--nproc-per-node", "0"],
            "`--nproc-per-node` must be at least 1. Received: --nproc-per-node 0",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "2"],
            "the node with --node-rank 0 that every node can reach), passed as "
            "--coordinator. Received: no --coordinator",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2"],
            "`--node-rank` must be in [0, 1] for a job of 2 node(s). Received: "
            "--node-rank 2",
        ),
        (
            ["--nproc-per-node", "1", "--coordinator", "nowhere"],
            "`--coordinator` looks like 'host:port'",
        ),
        (
            ["--nproc-per-node", "1", "--grace-period", "0"],
            "`--grace-period` must be positive. Received: --grace-period 0.0",
        ),
        (
            ["--nproc-per-node", "1", "--max-restarts", "-1"],
            "`--max-restarts` must be at least 0. Received: --max-restarts -1",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "3:2"],
            "--nnodes needs 1 <= MIN <= MAX. Received: '3:2'",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "one:2"],
            "--nnodes is a number of nodes (2) or a range MIN:MAX (1:2). "
            "Received: 'one:2'",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "1:2"],
            "needs both `--nnodes MIN` (the fewest nodes) and `--rdzv-endpoint` "
            "(the rendezvous' HOST:PORT). Received: --nnodes MIN 1, "
            "no --rdzv-endpoint",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", "x:1"]
            + ["--node-rank", "1"],
            "gets each node's rank and the coordinator from its rendezvous",
        ),
        (
            ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", "x:1"]
            + ["--node-timeout", "0"],
            "`--node-timeout` must be a positive number of seconds. Received: "
            "--node-timeout 0.0",
        ),
    ]
    for flags, expected in cases:
        status, _, err = run("launch", *flags, str(script))
        assert status == 2, (flags, err)
        assert expected in err, (flags, err)
        for name in ("nproc_per_node", "node_rank", "grace_period", "max_restarts"):
            assert name not in err, (flags, err)


def test_devices_names_the_engines_device_kind(run, monkeypatch):
    from keras_dist.backends import get_adapter  # noqa: PLC0415

    # What the engine says of a GPU (jax's device_kind, torch's
    # get_device_name), in place of this machine's CPU.
    monkeypatch.setattr(type(get_adapter()), "device_kind", lambda self: "NVIDIA H200")
    status, out, _ = run("devices", "--json")
    assert status == 0
    assert json.loads(out)["device_kind"] == "NVIDIA H200"
    status, out, _ = run("devices")
    assert "device_kind: NVIDIA H200" in out
