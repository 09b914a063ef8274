"""Every Python code block of the docs runs, or says why it cannot.

The docs are `README.md`, `docs/**/*.md` and the Markdown files a page
includes with a snippet line (`--8<-- "benchmarks/README.md:2"`: the site
shows them). Each ```python block of the docs runs as a standalone
script in a process of its own, in this suite's environment (the run's
`KERAS_BACKEND` and `KERAS_DIST_CPU_DEVICES`: 8 simulated devices on JAX and
TensorFlow, one process and one device on PyTorch), from an empty temporary
directory, with a timeout; it must exit with status 0. The process is forked
from one that has imported keras_dist, Keras and the backend and done nothing
else (`tests/fork_server.py`: the imports cost seconds a block). One test
per block, so xdist spreads them.

HTML comments on the lines right before a block (blank lines between them
allowed; they do not show on the rendered page) say how to run it:

- `<!-- not-run: <reason> -->`: the block is not run, for the reason given (it
  needs a cluster, several hosts or processes, a GPU, downloaded weights...).
  The reason must not be empty.
- `<!-- backends: jax tensorflow -->`: run the block under these backends
  (for instance a (2, 4) mesh needs the 8 simulated devices, which PyTorch's
  one process does not have). The page should say why, in words. A block
  without it runs under one backend, the same block always under the same one,
  the blocks spread over all three (what a block shows runs the same on every
  backend, which the rest of the suite proves; running each three times cost
  CI minutes it does not have).
- `<!-- run-with: snippets/data_and_model.py -->`: run that file (a path
  relative to `docs/`) first, in the same script. It defines what the block
  takes as given (`x`, `y`, `build_model()`), small enough for seconds on CPU.
- `<!-- needs: libtpu -->`: the block compiles for a TPU topology, which needs
  `libtpu` (no TPU): it runs only in tests/run_tpu_topology.sh's environment
  (`test_compiled_plan.py::test_docs_blocks_needing_libtpu_print_what_their_page_shows`),
  and is skipped elsewhere, saying so.

What a page shows a block printing is compared with what it prints: a
```text block marked `<!-- output -->` shows the whole standard output of
the closest Python block above it on the same page, and the test of that
block compares the two, line by line, trailing spaces and blank lines aside.
Numbers are compared as printed: at the precision the code prints them, digit
for digit (the page shows what the code prints, never a rounding of it).
Figures that depend on the host, not on the code (timings, compile times),
cannot be compared: the marker names them, `<!-- output: timings vary -->`
or `<!-- output: compile times vary -->` (`OUTPUT_VARIES`), and they are
masked on both sides, the rest of the text compared. XLA's compiled figures
(peak bytes, flops, collectives, the projections made from them) are the
same from run to run for the same JAX and libtpu, and are compared.

A marker that is not followed by a Python or shell block, or that names an
unknown backend or a missing file, fails the collection test. A block repeated
word for word in several places runs once.

Each command of a ```bash (`sh`, `shell`, `console`) block is run, word for
word, by a test: through `tests/doc_commands.py` (`run_documented("...")`, or
`documented_command("...")` for a test that runs it its own way), whose
literal calls in tests/ are the registry the block's commands are looked up
in. Otherwise the block says why not with `<!-- not-run: <reason> -->` (it
needs a cluster, your own script, installs packages...), or it is one of the
README's set-up commands that CI runs as written: its `<!-- NAME-command -->`
marker is one that `.ci/run` names (and runs the block after).

`docs/api.md` documents every name of `keras_dist.__all__`, the architecture
page's pictures are what `docs/images/architecture.py` draws, and
`mkdocs build --strict` must build the site (under JAX only: the build does
not depend on the backend; skipped, saying so, where the `docs` extra is not
installed).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import pathlib
import re
import runpy
import subprocess
import sys
import zlib

import keras
import pytest

from tests import doc_commands
from tests.fork_server import ForkServer, run_script

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BACKENDS = ("jax", "tensorflow", "torch")
BLOCK_TIMEOUT_S = 240  # a block takes seconds; the margin is for a busy machine

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\s`]*)")
MARKER = re.compile(
    r"^\s*<!--\s*(?P<key>not-run|backends|run-with|needs|output|[a-z][a-z-]*-command)\b:?"
    r"(?P<value>.*?)-->\s*$"
)
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
CI_SCRIPT = REPO / ".ci" / "run"


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    markers: dict[str, str]

    @property
    def name(self) -> str:
        path = self.path
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        return f"{shown}:{self.line}"


# A page's pymdownx snippet line, `--8<-- "path"` (`path:START`, `path:START:END`
# or `path:SECTION` for a part of it; a leading `;` escapes the line): that file
# is part of the page. mkdocs.yml's `base_path: ["."]` resolves the path from the
# repository's root.
SNIPPET = re.compile(r'^[ \t]*--8<--[ \t]+"(?P<path>[^":]+)(?::[^"]*)?"[ \t]*$')


def _included(page: pathlib.Path) -> list[pathlib.Path]:
    """The Markdown files `page` includes with a snippet line, whole or some of
    their lines. A file included as a code snippet (`examples/*.py`) is the
    example's code, not a page. A missing file fails `mkdocs build --strict`
    (`check_paths`)."""
    included = []
    for line in page.read_text().splitlines():
        match = SNIPPET.match(line)
        if match and match["path"].endswith(".md"):
            path = (REPO / match["path"]).resolve()
            if path.is_file() and path not in included:
                included.append(path)
    return included


def _documents() -> list[pathlib.Path]:
    """README.md, docs/**/*.md and what their pages include: what the site
    shows (benchmarks.md is benchmarks/README.md)."""
    documents = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    for page in documents:  # grows: an included file may include another
        documents.extend(path for path in _included(page) if path not in documents)
    return documents


def _blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the markers before each."""
    lines = path.read_text().splitlines()
    blocks = []
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = number + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip()
            for line in lines[number + 1 : end]
        ]
        blocks.append(
            Block(
                path=path,
                line=number + 1,
                language=opening["info"].lower(),
                code="\n".join(body) + "\n",
                markers=_markers_before(lines, number),
            )
        )
        number = end + 1
    return blocks


def _markers_before(lines: list[str], fence_index: int) -> dict[str, str]:
    markers: dict[str, str] = {}
    index = fence_index - 1
    while index >= 0:
        line = lines[index]
        if not line.strip():
            index -= 1
            continue
        match = MARKER.match(line)
        if match is None:
            break
        markers[match["key"]] = match["value"].strip()
        index -= 1
    return markers


def _python_blocks() -> list[Block]:
    return [
        block
        for path in _documents()
        for block in _blocks(path)
        if block.language in ("python", "py")
    ]


PYTHON_BLOCKS = _python_blocks()
SHELL_BLOCKS = [
    block
    for path in _documents()
    for block in _blocks(path)
    if block.language in SHELL_LANGUAGES
]


# Figures that depend on the host, not on the code (`<!-- output: NAME vary -->`,
# names joined by " and "): masked on both sides before the comparison.
OUTPUT_VARIES = {
    # The compile column of a compiled plan's table: right-aligned under its
    # header ("compile"), wider than any time below 1,000 s, so the table's
    # layout does not move with it.
    "compile times": (re.compile(r"\s+\d+(?:\.\d+)? s(?= │)"), " <seconds> s"),
    # Every number (the words around them are compared).
    "timings": (re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"), "<number>"),
}


def _varies(output: Block) -> list[str]:
    value = output.markers["output"]
    if not value:
        return []
    if not value.endswith(" vary"):
        raise ValueError(f"{output.name}: `output: {value}` must end with ' vary'")
    names = value[: -len(" vary")].split(" and ")
    unknown = [name for name in names if name not in OUTPUT_VARIES]
    if unknown:
        raise ValueError(
            f"{output.name}: `output` names {unknown}; known: {list(OUTPUT_VARIES)}"
        )
    return names


def _block_end(block: Block) -> int:
    """The 1-based line of `block`'s closing fence."""
    return block.line + block.code.count("\n") + 1


def _outputs(documents: list[pathlib.Path]) -> tuple[dict[str, Block], list[str]]:
    """{Python block name: the ```text block marked `output` that shows what
    it prints}, and what is wrong with the output markers."""
    outputs: dict[str, Block] = {}
    problems = []
    for path in documents:
        lines = path.read_text().splitlines()
        above = None
        for block in _blocks(path):
            if block.language in ("python", "py"):
                above = block
                continue
            right_after = above is not None and all(
                not line.strip() or MARKER.match(line)
                for line in lines[_block_end(above) : block.line - 1]
            )
            if "output" not in block.markers:
                if right_after and block.language == "text":
                    problems.append(
                        f"{block.name}: a text block right after {above.name} "
                        "without `<!-- output -->`: mark it, so that the test "
                        "of the block compares it with what the block prints"
                    )
                continue
            if block.language != "text" or above is None:
                problems.append(
                    f"{block.name}: `output` marks a ```text block below a "
                    "Python block of the same page"
                )
            elif above.name in outputs:
                problems.append(f"{block.name}: {above.name} has two outputs")
            else:
                try:
                    _varies(block)
                except ValueError as error:
                    problems.append(str(error))
                else:
                    outputs[above.name] = block
    return outputs, problems


OUTPUTS, OUTPUT_MARKER_PROBLEMS = _outputs(_documents())


def _output_lines(text: str, varies: list[str]) -> list[str]:
    for name in varies:
        pattern, replacement = OUTPUT_VARIES[name]
        text = pattern.sub(replacement, text)
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def output_problems(
    block: Block, printed: str, outputs: dict[str, Block] | None = None
) -> list[str]:
    """What differs between what `block` printed and what its page shows it
    printing (its `output` block in `outputs`, the docs' by default), as a
    diff; [] if it shows nothing."""
    shown = (OUTPUTS if outputs is None else outputs).get(block.name)
    if shown is None:
        return []
    varies = _varies(shown)
    page = _output_lines(shown.code, varies)
    run = _output_lines(printed, varies)
    if page == run:
        return []
    masked = f" ({' and '.join(varies)} masked)" if varies else ""
    diff = difflib.unified_diff(page, run, shown.name, "printed now", lineterm="")
    return [
        f"{shown.name} shows what {block.name} prints, but it prints otherwise"
        f"{masked}; update the page (or the code):\n" + "\n".join(diff)
    ]


def test_docs_have_python_blocks_and_every_marker_is_well_formed():
    assert any(block.path == REPO / "README.md" for block in PYTHON_BLOCKS)
    assert len(PYTHON_BLOCKS) >= 10, [block.name for block in PYTHON_BLOCKS]
    problems = []
    for block in PYTHON_BLOCKS:
        markers = block.markers
        if "not-run" in markers and not markers["not-run"]:
            problems.append(f"{block.name}: `not-run` gives no reason")
        if "not-run" in markers and len(markers) > 1:
            problems.append(f"{block.name}: `not-run` with other markers")
        if "backends" in markers:
            names = markers["backends"].split()
            if not names or set(names) - set(BACKENDS):
                problems.append(
                    f"{block.name}: `backends` must name some of {BACKENDS}. "
                    f"Received: {markers['backends']!r}"
                )
        if "needs" in markers and markers["needs"] != "libtpu":
            problems.append(
                f"{block.name}: `needs` takes `libtpu`. Received: {markers['needs']!r}"
            )
        if "output" in markers:
            problems.append(f"{block.name}: `output` marks the ```text block after")
        if "run-with" in markers and not (DOCS / markers["run-with"]).is_file():
            problems.append(
                f"{block.name}: `run-with` file docs/{markers['run-with']} "
                "does not exist"
            )
    for block in PYTHON_BLOCKS:
        for key in block.markers:
            if key.endswith("-command"):
                problems.append(f"{block.name}: `{key}` marks a shell block")
    problems += OUTPUT_MARKER_PROBLEMS
    # Every marker in the docs belongs to the Python, shell or output block
    # right after it.
    attached = sum(
        len(block.markers)
        for block in PYTHON_BLOCKS + SHELL_BLOCKS + list(OUTPUTS.values())
    )
    written = sum(
        1
        for path in _documents()
        for line in path.read_text().splitlines()
        if MARKER.match(line)
    )
    if written != attached:
        problems.append(
            f"{written - attached} marker(s) are not right before a Python, "
            "shell or output block (only blank lines and other markers may "
            "stand between them)"
        )
    assert problems == []


@pytest.mark.backend_neutral
def test_a_page_output_is_compared_whole_with_host_figures_masked(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('peak 20.04 MiB, step 0.129 ms, compile  9.1 s │')\n```\n"
        "\n<!-- output: compile times vary -->\n```text\n"
        "peak 20.04 MiB, step 0.129 ms, compile 40.3 s │   \n```\n"
        "\n```python\nprint('x')\n```\n\n```text\nx\n```\n"
        "\n```python\nprint(1)\n```\n<!-- output: colours vary -->\n"
        "```text\n1\n```\n"
    )
    outputs, problems = _outputs([page])
    shown, unmarked, colours = _blocks(page)[::2]
    assert list(outputs) == [shown.name]
    assert problems == [
        f"page.md:14: a text block right after {unmarked.name} without `<!-- "
        "output -->`: mark it, so that the test of the block compares it with "
        "what the block prints",
        f"page.md:22: `output` names ['colours']; known: {list(OUTPUT_VARIES)}",
    ]
    # The compile time is masked; every other figure is compared as printed.
    assert (
        output_problems(
            shown, "peak 20.04 MiB, step 0.129 ms, compile 7.8 s │\n", outputs
        )
        == []
    )
    (problem,) = output_problems(
        shown, "peak 20.04 MiB, step 0.1290 ms, compile 7.8 s │\n", outputs
    )
    assert problem.startswith(
        f"page.md:6 shows what {shown.name} prints, but it prints otherwise "
        "(compile times masked); update the page (or the code):"
    )
    assert "-peak 20.04 MiB, step 0.129 ms" in problem
    assert "+peak 20.04 MiB, step 0.1290 ms" in problem
    assert output_problems(unmarked, "anything", outputs) == []


def _commands(block: Block) -> list[str]:
    """The commands of a shell block, one a line (a line continuation joins
    two), without comments and blank lines, as `doc_commands.canonical`
    writes them."""
    commands = []
    for line in block.code.replace("\\\n", " ").splitlines():
        command = doc_commands.canonical(line)
        if command:
            commands.append(command)
    return commands


def _shell_block_problems(block: Block, registry: dict[str, str]) -> list[str]:
    markers = block.markers
    for key in ("backends", "run-with"):
        if key in markers:
            return [f"{block.name}: `{key}` is for Python blocks, not shell ones"]
    if "not-run" in markers:
        if not markers["not-run"]:
            return [f"{block.name}: `not-run` gives no reason"]
        return []
    ci_markers = [key for key in markers if key.endswith("-command")]
    if ci_markers:
        ci_script = CI_SCRIPT.read_text()
        return [
            f"{block.name}: `<!-- {key} -->` says CI runs this block, but "
            f"{CI_SCRIPT.relative_to(REPO)} does not run it"
            for key in ci_markers
            if block.path != REPO / "README.md"
            or not re.search(rf"(?<![\w-]){key}(?![\w-])", ci_script)
        ]
    return [
        f"{block.name}: `{command}` is run by no test. Run it word for word in "
        f'a test, through tests/doc_commands.py (`run_documented("{command}", '
        "...)`), or put `<!-- not-run: <why it cannot run in the tests> -->` on "
        "the line before the block"
        for command in _commands(block)
        if command not in registry
    ]


@pytest.mark.backend_neutral
def test_every_shell_command_of_the_docs_runs_in_a_test_or_says_why_not():
    registry = doc_commands.registered_commands()
    assert len(SHELL_BLOCKS) >= 10, [block.name for block in SHELL_BLOCKS]
    problems = [
        problem
        for block in SHELL_BLOCKS
        for problem in _shell_block_problems(block, registry)
    ]
    assert problems == [], "\n".join(problems)
    # And every command a test says it runs for the docs is in them.
    shown = {command for block in SHELL_BLOCKS for command in _commands(block)}
    shown |= {
        doc_commands.canonical(command)
        for path in _documents()
        for command in _inline_commands(path)
    }
    stale = {
        command: where for command, where in registry.items() if command not in shown
    }
    assert stale == {}, "commands the tests run that no shell block shows"


@pytest.mark.backend_neutral
def test_a_new_shell_block_without_a_test_or_marker_fails_naming_the_fix(tmp_path):
    page = tmp_path / "new.md"
    page.write_text(
        "```bash\nkeras-dist launch --nproc-per-node 2 my_new_script.py  # hi\n```\n"
        "\n<!-- not-run -->\n```bash\nsbatch job.sbatch\n```\n"
        "\n<!-- backends: jax -->\n```sh\nkeras-dist devices\n```\n"
    )
    new, empty, python_marker = (
        dataclasses.replace(block, path=REPO / "docs" / "new.md")
        for block in _blocks(page)
    )
    (problem,) = _shell_block_problems(new, {})
    assert problem == (
        "docs/new.md:1: `keras-dist launch --nproc-per-node 2 my_new_script.py` "
        "is run by no test. Run it word for word in a test, through "
        'tests/doc_commands.py (`run_documented("keras-dist launch '
        '--nproc-per-node 2 my_new_script.py", ...)`), or put `<!-- not-run: '
        "<why it cannot run in the tests> -->` on the line before the block"
    )
    registered = {doc_commands.canonical(new.code): "tests/x.py:1"}
    assert _shell_block_problems(new, registered) == []
    assert _shell_block_problems(empty, {}) == [
        "docs/new.md:6: `not-run` gives no reason"
    ]
    assert _shell_block_problems(python_marker, {}) == [
        "docs/new.md:11: `backends` is for Python blocks, not shell ones"
    ]
    # Commands compare as a shell splits them; an open quote keeps the words.
    assert doc_commands.canonical('a "b c" \\\n  d  # e') == "a 'b c' d"
    assert doc_commands.canonical("echo 'open  quote") == "echo 'open quote"
    ci_block = dataclasses.replace(new, markers={"unknown-command": ""})
    assert _shell_block_problems(ci_block, {}) == [
        "docs/new.md:1: `<!-- unknown-command -->` says CI runs this block, but "
        ".ci/run does not run it"
    ]


@pytest.mark.backend_neutral
def test_shell_and_inline_checks_read_the_markdown_a_page_includes(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        '--8<-- "benchmarks/README.md:2"\n'
        '--8<-- "examples/fine_tune_llm.py"\n'
        ';--8<-- "README.md"\n'
        '```python\n--8<-- "benchmarks/README.md:1:3"\n```\n'
    )
    benchmarks = REPO / "benchmarks" / "README.md"
    assert _included(page) == [benchmarks]
    assert benchmarks in _documents()
    assert any(block.path == benchmarks for block in SHELL_BLOCKS)
    assert any(
        command.startswith("python benchmarks/run.py")
        for command in _inline_commands(benchmarks)
    )


# An inline command that runs a script (`python examples/x.py`,
# `keras-dist launch ... script.py`, `tests/run_suite.sh`): run by a test as
# written, or named here with why it is not.
INLINE_COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(?:python3?|keras-dist|torchrun|srun|pytest)"
    r"\b.*\S\.(?:py|sh)\b|^tests/\S+\.sh\b"
)
INLINE_NOT_RUN = {
    "keras-dist launch --nproc-per-node 2 train.py": "train.py is your script",
    "keras-dist launch --nproc-per-node N script.py": "script.py is your script",
    "torchrun ... train.py": "train.py is your script",
    "srun python train.py": "needs SLURM",
    "python train.py": "train.py is your script",
    "keras-dist launch --nproc-per-node N train.py": "train.py is your script",
    "tests/gpu_wheels.sh": "downloads wheels for the GPU machine's Python 3.12",
    "tests/run_gpu.sh": "needs an NVIDIA GPU (KERAS_DIST_GPU_TESTS_ON_CPU=1 and "
    "--smoke check it on a CPU, by hand: minutes)",
    "KERAS_BACKEND=jax python benchmarks/gpu_speed.py": "a benchmark for a GPU: "
    "its figures are the GPU's (--smoke checks the script on a CPU)",
    "KERAS_BACKEND=torch python benchmarks/gpu_speed.py": "a benchmark for a GPU: "
    "its figures are the GPU's (--smoke checks the script on a CPU)",
    "python benchmarks/gemma_full_finetune.py --offload none --dtype mixed_bfloat16 "
    "--batch 8": "needs a GPU: a Gemma-2B-shaped model, 2.5 G parameters",
    "XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 python benchmarks/llama_8b_capped.py": "needs "
    "a GPU of more than 80 GB: an 8 G-parameter model",
    "python -m pytest tests/test_package_rules.py": "a test file: the suite runs it",
    "tests/run_suite.sh": "CI runs it: it is the README's test command",
    "tests/run_all_backends.sh": "run by tests/run_suite.sh, which CI runs",
    "tests/run_keras_nightly.sh": "run by tests/run_suite.sh, which CI runs",
    "tests/run_torch_release.sh VERSION": "installs another torch release",
    "tests/keras_own/run.sh": "runs Keras' own test suite, for minutes",
    "python examples/ray_train.py --backend jax": "starts a local Ray cluster, too "
    "slow for CI: tests/integrations/test_ray.py runs what it uses",
    "KERAS_BACKEND=jax python examples/fine_tune_llm.py": "the record of a run on "
    "a TPU chip; the page's CPU commands run in tests/test_fine_tune_recipe.py",
    "KERAS_BACKEND=jax python benchmarks/compiled_plan_check.py": "needs a TPU "
    "chip: it trains on the chip it plans for",
    "TPU_SKIP_MDS_QUERY=1 KERAS_BACKEND=jax python plan_slice.py": "a block that "
    "needs libtpu, saved as a file: how the output shown was made",
    "KERAS_BACKEND=jax python benchmarks/compiled_plan_check.py --topology local "
    "--models mlp,transformer --precisions fp32": "needs an accelerator: it "
    "trains on the devices it plans for (CPUs report no memory to compare)",
    "KERAS_BACKEND=jax python benchmarks/host_transfer_check.py": "needs a TPU "
    "chip: its figures are on the page",
    "python benchmarks/offload.py --mode compiled --layers 8 --width 8192 "
    "--accumulation 4": "a benchmark that compiles for a TPU chip (libtpu, minutes "
    "of CPU): its figures are on the page",
    "KERAS_BACKEND=jax python benchmarks/offload_process_peak.py --layers 20 "
    "--no-save-restore": "needs a TPU chip (5 GiB of weights, 10 GiB of host "
    "state): its figures are on the page",
}
# The commands of benchmarks/README.md's prose and table (the benchmarks page
# shows it): benchmarks of minutes, or for a TPU chip.
_RUN_ENTRY = "a benchmark: minutes of timed fits (run.py allows an entry 5 to 10 min)"
INLINE_NOT_RUN.update(
    {
        "python benchmarks/run.py --entries jax_data_parallel": _RUN_ENTRY,
        "python benchmarks/run.py --entries tf_mirrored --repeats 9 --steps 40": (
            _RUN_ENTRY
        ),
        "python benchmarks/run.py --entries torch_ddp": _RUN_ENTRY,
        "python benchmarks/run.py --entries torch_ddp_mlp_1": _RUN_ENTRY,
        "python benchmarks/run.py --entries jax_fsdp jax_fsdp_4 jax_fsdp_2": (
            _RUN_ENTRY
        ),
        "python benchmarks/run.py --entries torch_fsdp": _RUN_ENTRY,
        "python benchmarks/run.py --entries throughput_overhead": _RUN_ENTRY,
        "KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 python benchmarks/auto.py "
        "--layers 4 --width 1024 --device-memory 1GiB --race": "a benchmark: a "
        "search, then timed fits of five distributions",
        "KERAS_DIST_BENCH_JIT=1 KERAS_DIST_BENCH_BREAKDOWN=1 KERAS_BACKEND=torch "
        "PYTHONPATH=. python -m keras_dist launch --nproc-per-node 2 "
        "benchmarks/entries/torch_ddp_mlp.py --repeats 15 --steps 40": "a "
        "benchmark: minutes of timed fits in 2 processes, torch.compile warm-ups "
        "included",
        "PYTHONPATH=. python benchmarks/scaling.py --rounds 2 --repeats 5 "
        "--steps 30": "a benchmark: 2 rounds of 9 run.py entries, minutes each",
        "KERAS_BACKEND=torch PYTHONPATH=. python benchmarks/fsdp_memory.py "
        "--compare --repeats 2": "a memory benchmark: sixteen 2-process jobs "
        "training a 25.2 M-parameter MLP",
        "KERAS_BACKEND=torch PYTHONPATH=. python -m keras_dist launch "
        "--nproc-per-node 2 benchmarks/fsdp_memory.py --policy fsdp_keep": "a "
        "memory benchmark: 2 processes train a 25.2 M-parameter MLP, a thread "
        "sampling malloc every 0.2 ms",
        "PYTHONPATH=. python benchmarks/context_parallel.py": "a benchmark: 20 to "
        "30 minutes on a 2-core host",
        "KERAS_BACKEND=jax python benchmarks/accelerator.py --interleave 2 "
        "--interleaved-only": "needs a TPU chip: its figures are the chip's",
        "KERAS_BACKEND=jax python benchmarks/accelerator_features.py": "needs a TPU "
        "chip: on CPU it skips the MFU and device-memory checks",
        "KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 python "
        "benchmarks/wait_for_steps.py": "a benchmark: 7 pairs of timed 20-epoch "
        "fits on 8 simulated devices",
        "KERAS_BACKEND=jax python benchmarks/context_parallel_plan.py": "needs "
        "libtpu: compiles a Gemma-2B-shaped step for TPU slices, 2 to 25 minutes "
        "a case on a 2-core host",
        "PYTHONPATH=. python benchmarks/torch_batch_norm.py --repeats 200": "a "
        "benchmark: 200 interleaved timings of each way's BatchNormalization step",
        "KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/mixed_precision.py "
        "--compare --repeats 2": "needs a TPU chip: the chip's peak memory of a "
        "117.6 M-parameter decoder",
    }
)


def _inline_commands(path: pathlib.Path) -> list[str]:
    """The inline code spans of `path` (outside fenced blocks) that
    `INLINE_COMMAND` takes for a command."""
    text = path.read_text()
    outside = re.sub(
        r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$", "", text, flags=re.M | re.S
    )
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", outside)
    return [
        " ".join(span.split())
        for span in spans
        if INLINE_COMMAND.match(" ".join(span.split()))
    ]


def _inline_problems(path: pathlib.Path, registry: dict[str, str]) -> list[str]:
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    return [
        f"{name}: the command `{command}` is run by no test. Run "
        "it word for word in a test, through tests/doc_commands.py "
        f'(`run_documented("{command}", ...)`), or add it to INLINE_NOT_RUN in '
        "tests/test_docs_code_blocks.py with why it cannot run in the tests"
        for command in _inline_commands(path)
        if doc_commands.canonical(command) not in registry
        and command not in INLINE_NOT_RUN
    ]


@pytest.mark.backend_neutral
def test_every_inline_command_of_the_docs_runs_in_a_test_or_says_why_not(tmp_path):
    registry = doc_commands.registered_commands()
    found = {command for path in _documents() for command in _inline_commands(path)}
    assert "KERAS_BACKEND=jax python examples/fine_tune_llm.py" in found
    problems = [
        problem for path in _documents() for problem in _inline_problems(path, registry)
    ]
    assert problems == [], "\n".join(problems)
    assert set(INLINE_NOT_RUN) <= found, "INLINE_NOT_RUN names commands no page shows"
    assert all(INLINE_NOT_RUN.values())
    page = tmp_path / "new.md"
    page.write_text(
        "Run `python examples/new.py --fast` and `keras-dist devices`.\n"
        "```bash\npython examples/in_a_block.py\n```\n"
    )
    assert _inline_commands(page) == ["python examples/new.py --fast"]
    assert _inline_problems(page, {}) == [
        "new.md: the command `python examples/new.py --fast` is run by no test. "
        "Run it word for word in a test, through tests/doc_commands.py "
        '(`run_documented("python examples/new.py --fast", ...)`), or add it to '
        "INLINE_NOT_RUN in tests/test_docs_code_blocks.py with why it cannot run "
        "in the tests"
    ]
    registered = {doc_commands.canonical("python examples/new.py --fast"): "x"}
    assert _inline_problems(page, registered) == []


def _block_environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environment["MPLBACKEND"] = "Agg"
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), environment.get("PYTHONPATH")])
    )
    return environment


@pytest.fixture(scope="session")
def script_server(tmp_path_factory):
    """Started at the first block this test process runs, ended with the
    session (`tests/fork_server.py`)."""
    servers: list[ForkServer] = []

    def get() -> ForkServer:
        if not servers:
            log = tmp_path_factory.mktemp("script_server") / "server.log"
            servers.append(ForkServer(_block_environment(), log))
        return servers[0]

    yield get
    for server in servers:
        server.stop()


def _run_block(
    block: Block, directory: pathlib.Path, server: ForkServer
) -> subprocess.CompletedProcess:
    """The block as `python block.py` from `directory`, in a process forked
    from `server` (the imports done; see tests/fork_server.py)."""
    source = block.code
    if "run-with" in block.markers:
        setup = (DOCS / block.markers["run-with"]).read_text()
        source = f"{setup}\n# --- {block.name} ---\n{block.code}"
    script = directory / "block.py"
    script.write_text(source)
    return run_script(server, script, directory, timeout=BLOCK_TIMEOUT_S)


def _blocks_to_run() -> list[Block]:
    """The blocks without `not-run` or `needs`; a block repeated word for
    word (the README's example is also the home page's) runs once."""
    unique: dict[tuple, Block] = {}
    for block in PYTHON_BLOCKS:
        if "not-run" not in block.markers and "needs" not in block.markers:
            key = (
                block.code,
                block.markers.get("run-with"),
                block.markers.get("backends"),
            )
            unique.setdefault(key, block)
    return list(unique.values())


def _backends_of(block: Block) -> list[str]:
    """Where `block` runs: the backends its marker names, or else one backend
    (each block runs the same on all three; the suite's own tests prove that
    for what they show): spread over the three by the block's place, so that
    every backend runs a share of the docs."""
    if "backends" in block.markers:
        return block.markers["backends"].split()
    return [BACKENDS[zlib.crc32(block.name.encode()) % len(BACKENDS)]]


@pytest.mark.parametrize("block", _blocks_to_run(), ids=lambda block: block.name)
def test_docs_code_block_runs(block: Block, tmp_path: pathlib.Path, script_server):
    backend = keras.backend.backend()
    wanted = _backends_of(block)
    if backend not in wanted:
        pytest.skip(f"{block.name} runs on {wanted}; this run is {backend}")
    result = _run_block(block, tmp_path, script_server())
    assert result.returncode == 0, (
        f"{block.name} exited with status {result.returncode} on {backend}.\n"
        f"--- stdout (tail) ---\n{result.stdout[-3000:]}\n"
        f"--- stderr (tail) ---\n{result.stderr[-6000:]}"
    )
    problems = output_problems(block, result.stdout)
    assert problems == [], "\n".join(problems)


def _public_names() -> list[str]:
    """`keras_dist.__all__`, read from the source (no import)."""
    tree = ast.parse((REPO / "keras_dist" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__"
            for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError("keras_dist/__init__.py defines no __all__")


def test_api_reference_documents_every_public_name():
    documented = re.findall(
        r"^::: (keras_dist[\w.]*)", (DOCS / "api.md").read_text(), re.M
    )
    # `keras_dist.NAME`, or NAME at the module that defines it (the function
    # `distribution` shares its name with the subpackage `keras_dist.distribution`).
    missing = [
        name
        for name in _public_names()
        if f"keras_dist.{name}" not in documented
        and not any(
            path.endswith(f".{name}") and path.count(".") > 1 for path in documented
        )
    ]
    assert missing == []
    assert "keras_dist.callbacks.Throughput" in documented


def test_architecture_pictures_are_what_their_script_draws():
    script = runpy.run_path(str(DOCS / "images" / "architecture.py"))
    images = DOCS / "images"
    assert (images / "layers.svg").read_text() == script["layers"](), (
        "run python docs/images/architecture.py"
    )
    assert (images / "fit-path.svg").read_text() == script["fit_path"](), (
        "run python docs/images/architecture.py"
    )


def _docs_packages_missing() -> list[str]:
    wanted = {
        "mkdocs": "mkdocs",
        "material": "mkdocs-material",
        "mkdocstrings_handlers.python": "mkdocstrings-python",
    }
    missing = []
    for module, package in wanted.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    return missing


@pytest.mark.backend("jax")
def test_mkdocs_build_strict(tmp_path: pathlib.Path):
    missing = _docs_packages_missing()
    if missing:
        pytest.skip(
            f"the docs extra is not installed ({', '.join(missing)} missing): "
            'pip install -e ".[docs]"'
        )
    environment = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=REPO,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "architecture" / "index.html").is_file()
    assert (tmp_path / "api" / "index.html").is_file()
