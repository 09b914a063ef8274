"""What the documentation and the package extras promise.

Relative paths in the docs, the README's word on `scope()` (backed by what
`fit` does), and a GPU-capable TensorFlow for `keras-dist[tensorflow]` with the
CPU-only build kept to the CPU set-up.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.training.session import active_run
from tests.doc_commands import documented_command

# The same under every backend: run once (tests/conftest.py).
pytestmark = pytest.mark.backend_neutral

REPO = pathlib.Path(__file__).resolve().parents[1]
# A home or work directory of some machine: /home/ann/..., /Users/bo/..., /work/...
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:home|Users|root|work)/[\w.-]+")


def _documents() -> list[pathlib.Path]:
    skipped = {".venv", ".git", "node_modules"}
    return [
        path
        for path in REPO.rglob("*.md")
        if not skipped & set(path.relative_to(REPO).parts)
        and not any(part.endswith(".egg-info") for part in path.parts)
    ]


def test_documents_name_no_path_of_a_development_machine():
    documents = _documents()
    assert REPO / "benchmarks" / "README.md" in documents
    found = {
        str(path.relative_to(REPO)): MACHINE_PATH.findall(path.read_text())
        for path in documents
    }
    assert {name: paths for name, paths in found.items() if paths} == {}
    for path in documents:
        assert str(REPO) not in path.read_text(), path


def _words(text: str) -> str:
    return " ".join(text.split())


# Trains under the suite's backend: on every backend.
@pytest.mark.backend("jax", "tensorflow", "torch")
def test_readme_says_scope_distributes_only_trainer_models_and_fit_agrees():
    readme = _words((REPO / "README.md").read_text())
    assert (
        "`with distribution.scope(): model.fit(...)` distributes only "
        "`kd.Trainer` models" in readme
    )

    class Trainer(kd.Trainer, keras.Model):
        pass

    distributed = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            distributed[self.model.name] = active_run(self.model) is not None

    x = np.ones((16, 2), "float32")
    distribution = kd.DataParallel()
    with distribution.scope():
        for name, model_class in (("plain", keras.Model), ("trainer", Trainer)):
            inputs = keras.Input((2,))
            model = model_class(inputs, keras.layers.Dense(1)(inputs), name=name)
            model.compile(optimizer="sgd", loss="mse")
            model.fit(x, x[:, :1], batch_size=8, verbose=0, callbacks=[Probe()])
    assert distributed == {"plain": False, "trainer": True}


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(REPO / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["optional-dependencies"]


def test_tensorflow_extra_is_the_gpu_capable_tensorflow():
    extras = _extras()
    assert extras["tensorflow"] == ["tensorflow>=2.21"]
    assert "keras-dist[jax,torch,tensorflow,ray,plan,examples,test]" in extras["all"]


def test_each_integration_that_needs_a_library_has_its_extra():
    extras = _extras()
    assert extras["ray"] == ["ray[train]>=2.50"]
    assert (
        "keras-dist[jax,torch,tensorflow-cpu,ray,plan,examples,test]"
        in extras["all-cpu"]
    )


def test_cpu_only_tensorflow_belongs_to_the_cpu_set_up():
    extras = _extras()
    cpu = extras["tensorflow-cpu"]
    assert any(
        r.startswith("tensorflow-cpu") and "platform_machine == 'x86_64'" in r
        for r in cpu
    )
    # No tensorflow-cpu wheel outside x86_64: the plain one there.
    assert any(
        r.startswith("tensorflow>") and "platform_machine != 'x86_64'" in r for r in cpu
    )
    assert (
        "keras-dist[jax,torch,tensorflow-cpu,ray,plan,examples,test]"
        in extras["all-cpu"]
    )
    readme = (REPO / "README.md").read_text()
    command = readme.split("<!-- test-command -->")[1].split("```")[1]
    assert '-c constraints/cpu.txt -e ".[all-cpu]"' in command


def test_the_cpu_torch_command_brings_the_pinned_torch_from_pytorchs_cpu_index():
    readme = (REPO / "README.md").read_text()
    command = readme.split("<!-- cpu-torch-command -->")[1].split("```")[1]
    pinned = [
        line.strip()
        for line in (REPO / "constraints" / "cpu.txt").read_text().splitlines()
        if line.strip().startswith("torch==")
    ]
    assert pinned == ["torch==2.13.0"]
    # The same torch as the pin (its +cpu build satisfies it), from PyTorch's
    # own CPU wheel index, into the venv the set-up commands use.
    assert f"pip install {pinned[0]} " in command
    assert "--index-url https://download.pytorch.org/whl/cpu" in command
    assert ".venv/bin/pip" in command
    # The version PyTorch's CPU index serves satisfies the constraint.
    from packaging.specifiers import SpecifierSet

    assert "2.13.0+cpu" in SpecifierSet(pinned[0].removeprefix("torch"))


# A shell line that runs the venv's programs by their bare names, as the docs
# write them (`python examples/...`, `KERAS_BACKEND=jax keras-dist devices`).
BARE_COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:python|keras-dist|pytest) ", re.M)
# Run by `test_activating_the_venv_gives_the_docs_commands` (the docs' registry:
# tests/doc_commands.py).
ACTIVATE = documented_command("source .venv/bin/activate")


def _shell_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(
        r"^```(?:bash|sh|console)\n(.*?)^```", path.read_text(), re.M | re.S
    )


def test_the_docs_bare_commands_come_after_activating_the_readmes_venv():
    # The README's set-up makes `.venv` and calls `.venv/bin/...` without
    # activating it; the docs then write `python ...` and `keras-dist ...`,
    # which are not the venv's until it is activated: where the commands
    # first appear, the docs say how, and so does the README.
    blocks = _shell_blocks(REPO / "docs" / "getting-started.md")
    first_bare = next(i for i, block in enumerate(blocks) if BARE_COMMAND.search(block))
    assert any(ACTIVATE in block for block in blocks[:first_bare]), blocks[first_bare]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert ACTIVATE in readme
    assert ACTIVATE in " ".join((REPO / "docs" / "index.md").read_text().split())


def test_activating_the_venv_gives_the_docs_commands():
    # What the note promises: after it, `python` and `keras-dist` are the
    # venv's (where this suite runs from the README's venv).
    venv = REPO / ".venv"
    if not (venv / "bin" / "activate").is_file():
        pytest.skip("no .venv here: the suite does not run from the README's set-up")
    found = subprocess.run(
        ["bash", "-c", f"{ACTIVATE} && command -v python && command -v keras-dist"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [
        str(venv / "bin" / "python"),
        str(venv / "bin" / "keras-dist"),
    ]


def test_keras_hub_imports_with_what_the_test_extra_brings():
    pytest.importorskip("keras_hub")  # installed by the README's test command
    extras = _extras()
    assert {"regex", "tokenizers"} <= set(extras["test"])
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "the two it needs to import, `regex` and `tokenizers`" in readme


def test_every_test_the_keras_nightly_run_names_exists():
    """tests/keras_nightly_tests.txt names files and test functions by hand: a
    renamed test must fail here, not drop out of the nightly run unseen."""
    listed = [
        line.strip()
        for line in (REPO / "tests" / "keras_nightly_tests.txt")
        .read_text()
        .splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert listed
    for entry in listed:
        path, _, function = entry.partition("::")
        function, _, parameters = function.partition("[")
        source = REPO / path
        assert source.is_file(), entry
        if function:
            assert re.search(rf"^def {function}\(", source.read_text(), re.M), entry
