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


def test_the_cuda_extra_is_jax_with_its_cuda_plugin_and_the_gpu_page_says_so():
    extras = _extras()
    assert extras["cuda"] == ["keras-dist[jax]", "jax[cuda13]>=0.10"]
    page = (REPO / "docs" / "gpus.md").read_text()
    assert 'pip install "keras-dist[cuda]"' in page
    assert "tensorflow[and-cuda]" in page and "download.pytorch.org" in page


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


# Project-internal references: "issue 25", "issues 3 and 4" (the first
# number), "issue #25", "PR 12", "pull request 12", a bare "#25". An upstream
# reference (`keras-team/keras#20585`, `keras#19246`, a link to
# `.../issues/20585` or `.../pull/20585`) near it keeps it.
INTERNAL_REFERENCE = re.compile(
    r"\b(?:issues?|PRs?|pull\s+requests?)\s*#?\s*(\d+)\b|(?<![\w/.#&-])#(\d+)\b",
    re.I,
)
# Diary wording: when or in which session a thing changed, not what it does.
DIARY_PHRASES = [
    r"\b(?:again|run|re-?run|measured|checked|tested)\s+now\b",  # "run again now"
    r"\b(?:is|are|was|were|has|have|had|does|do|did|will|can)\s+now\b",  # "is now"
    r"\b(?:keras_dist|it|this|which|that|they)\s+now\b",  # "keras_dist now runs"
    r"\bnow\s*[),;:]",  # "allocates 9.96 now, above"; "(... now)"
    r"(?:^|[.!?]\s+)Now\s+(?!that\b)",  # a sentence opening "Now ..."
    r"\bas\s+of\s+(?:today|now|this|these|writing)\b",  # "as of this change"
    r"\btoday'?s?\b|\byesterday\b|\blast\s+(?:week|night|session)\b",
    r"\bthis\s+(?:session|change|PR|commit|branch)\b",  # "before this change"
    r"\b(?:before|after|since|until)\s+(?:this|the|that|our)\b[^.;]{0,40}?"
    r"\b(?:change|fix|commit|merge)\b",  # "after the `set_timeout` fix"
    r"\bfixed\s*:|:\s*fixed\b|\b(?:was|were)\s+a\s+bug\b",  # "(resume: fixed)"
]


def _user_documents() -> list[pathlib.Path]:
    """The pages users read: the README, docs/, the benchmarks' README and the
    integrations' and examples' READMEs (the CHANGELOG is a history: not
    these)."""
    return [
        REPO / "README.md",
        REPO / "benchmarks" / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *sorted(REPO.glob("integrations/*/README.md")),
        *sorted(REPO.glob("examples/**/README.md")),
    ]


def _diary(text: str) -> list[tuple[int, str]]:
    """`(line, words)` for each project-issue reference and each diary phrase
    of `text` (a phrase may run over a line break), in the order found.

    Caught: "issue 25", "issue #25", "issues 3", "PR 12", "pull request 12",
    a bare "#25" (kept when an upstream reference with that number,
    `owner/repo#25`, `keras#25` or a link to `.../issues/25` or
    `.../pull/25`, stands on the same or the next line); "run again now",
    "measured now", "is now", "keras_dist now ...", "it now ...", "now" before
    `)`, `,`, `;` or `:`, a sentence opening with "Now" (not "Now that"),
    "as of today / now / this change / writing", "today", "today's",
    "yesterday", "last week", "this session", "this change", "this PR",
    "before this change", "after the ... fix", "since the ... commit",
    "(resume: fixed)", "fixed: ...", "was a bug"."""
    found = []
    for match in INTERNAL_REFERENCE.finditer(text):
        number = match.group(1) or match.group(2)
        start = text.rfind("\n", 0, match.start()) + 1
        end = text.find("\n", text.find("\n", match.end()) + 1)
        around = text[start : end if end != -1 else len(text)]
        upstream = rf"[\w.-]+#{number}\b|/(?:issues|pull)/{number}\b"
        if not re.search(upstream, around):
            found.append((match.start(), match.group(0)))
    for phrase in DIARY_PHRASES:
        found += [(m.start(), m.group(0)) for m in re.finditer(phrase, text, re.I)]
    return [
        (text.count("\n", 0, offset) + 1, " ".join(words.split()))
        for offset, words in sorted(found)
    ]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("On JAX none did (issue\n25's run).", [(1, "issue\n25")]),
        ("fixed in issue #7, and PR 9", [(1, "issue #7"), (1, "PR 9")]),
        ("see (#31)", [(1, "#31")]),
        ("Run again now: it trains.", [(1, "again now"), (1, "now:")]),
        ("x\nkeras_dist now runs it.", [(2, "keras_dist now")]),
        ("It allocates 9.96 now, above.", [(1, "now,")]),
        ("As of today it is faster.", [(1, "As of today"), (1, "today")]),
        ("same (resume: fixed)", [(1, ": fixed")]),
        (
            "all passed after the `set_timeout` fix",
            [(1, "after the `set_timeout` fix")],
        ),
        (
            "| same, before this change |",
            [(1, "before this change"), (1, "this change")],
        ),
    ],
)
def test_the_diary_check_catches_issue_numbers_and_diary_phrases(text, expected):
    assert _diary(text) == [(line, " ".join(words.split())) for line, words in expected]


@pytest.mark.parametrize(
    "text",
    [
        "clear `ValueError` (keras#19246)",
        "KerasHub's maps (keras-hub#2827), Keras issue 20585 (keras-team/keras#20585)",
        "[issue 1628](https://github.com/keras-team/keras-hub/issues/1628)",
        "Now that the model is built, fit it. Until now nothing ran.",
        "steps since the last save are trained again; the job starts again",
        "it issues the collectives together; `torch_ddp` with `--repeats 15`",
    ],
)
def test_the_diary_check_keeps_upstream_references_and_plain_words(text):
    assert _diary(text) == []


def test_user_documents_speak_of_the_product_not_of_its_history():
    documents = _user_documents()
    assert REPO / "docs" / "architecture.md" in documents
    found = [
        f"{path.relative_to(REPO)}:{line}: {words!r}"
        for path in documents
        for line, words in _diary(path.read_text())
    ]
    assert found == [], (
        "These lines say when or by which issue a thing changed; say what it does "
        "and how it is measured instead (a measurement's date beside its figure "
        "is fine; an upstream reference as owner/repo#N or keras#N is kept): "
        + "; ".join(found)
    )


# pymdownx.snippets includes a file where a line reads exactly `--8<-- "path"`,
# `"path:N"` (from line N) or `"path:name"` (between `--8<-- [start:name]` and
# `[end:name]`). Anything else near it is shown as text: a formatter that turned
# `--8<--` into `--8 < --` left a page showing that line instead of its script.
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<part>[^"]+))?"$')
SNIPPET_LIKE = re.compile(r"^\s*-+\s*8\s*<")


def _snippet_problems(path: pathlib.Path) -> list[str]:
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not SNIPPET_LIKE.match(line):
            continue
        where = f"{path.relative_to(REPO)}:{number}"
        included = SNIPPET.match(line)
        if included is None:
            problems.append(
                f'{where}: {line!r} is not a snippet line: write --8<-- "path" '
                '(or "path:N", "path:name")'
            )
            continue
        source = REPO / included["path"]
        if not source.is_file():
            problems.append(f"{where}: {included['path']} does not exist")
            continue
        part = included["part"]
        if part is None:
            continue
        text = source.read_text()
        if part.isdigit():
            if int(part) > len(text.splitlines()):
                problems.append(f"{where}: {included['path']} has no line {part}")
        elif f"--8<-- [start:{part}]" not in text or f"--8<-- [end:{part}]" not in text:
            problems.append(
                f"{where}: {included['path']} has no section {part!r} "
                f"(--8<-- [start:{part}] ... --8<-- [end:{part}])"
            )
    return problems


def test_every_snippet_line_of_the_docs_includes_what_it_names():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    included = [
        page
        for page in pages
        if any(SNIPPET_LIKE.match(line) for line in page.read_text().splitlines())
    ]
    assert {page.name for page in included} >= {"tpu-pods.md", "fine-tuning.md"}
    problems = [problem for page in pages for problem in _snippet_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_snippet_check_catches_a_reformatted_line_and_a_missing_section(tmp_path):
    page = REPO / "docs" / "_snippet_check_probe.md"
    page.write_text(
        '--8 < --"examples/tpu_pod.py"\n'
        '--8<-- "examples/fine_tune_llm.py:no_such_section"\n'
        '--8<-- "examples/no_such_example.py"\n'
        '--8<-- "examples/fine_tune_llm.py:model"\n'
    )
    try:
        problems = _snippet_problems(page)
    finally:
        page.unlink()
    assert len(problems) == 3, problems
    assert "is not a snippet line" in problems[0]
    assert "no section 'no_such_section'" in problems[1]
    assert "does not exist" in problems[2]
