"""The shell commands of README.md and docs/ (with the Markdown files its pages
include, such as benchmarks/README.md), run by the tests as written.

A test that runs a command a ```bash block shows writes it word for word:
`run_documented("keras-dist launch --nproc-per-node 2 examples/x.py")` runs
it; `documented_command("...")` only names it, for a test that runs it its own
way. tests/test_docs_code_blocks.py reads every such call with a literal
string in tests/ (without importing them: `registered_commands`): that is the
registry a block's commands must be in, unless the block says
`<!-- not-run: reason -->`. Commands compare as a shell splits them (quotes,
spaces and `# comments` aside).

`run_documented` runs the command the way a user's shell would, in the
suite's own environment: `python`, `python3` and `.venv/bin/python` are this
interpreter, `keras-dist` and `.venv/bin/keras-dist` its `python -m
keras_dist`, `torchrun` its `python -m torch.distributed.run`. Leading
`NAME=value` words set variables. The suite's job variables (`KERAS_BACKEND`,
`KERAS_DIST_*`, `RANK`...) are cleared first: a user's shell has none. It
runs from a fresh directory holding links to the repository's top-level
entries, so relative paths (`examples/...`) resolve and what the command
writes stays out of the repository.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
REGISTERING = ("documented_command", "run_documented")

# A program of a documented command -> what runs it here.
PROGRAMS = {
    "python": [sys.executable],
    "python3": [sys.executable],
    ".venv/bin/python": [sys.executable],
    "keras-dist": [sys.executable, "-m", "keras_dist"],
    ".venv/bin/keras-dist": [sys.executable, "-m", "keras_dist"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
# What a user's shell does not have: the job the suite runs in.
_JOB_VARIABLES = (
    "KERAS_BACKEND",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
)


def canonical(command: str) -> str:
    """`command` as a shell splits it, re-joined: the form commands compare in.
    A line continuation (backslash, newline) joins the lines; a line a shell
    would not end there (an open quote) keeps its words as written."""
    joined = command.replace("\\\n", " ")
    try:
        return shlex.join(shlex.split(joined, comments=True))
    except ValueError:
        return " ".join(joined.split())


def documented_command(command: str) -> str:
    """Name `command`, a command the docs show, as run by the calling test
    (which runs it its own way); returns it unchanged."""
    return command


def run_documented(
    command: str,
    *,
    directory: pathlib.Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run `command` as a shell would from `directory` (filled with links to
    the repository's entries; see the module's docstring), with `env` added
    to the environment; its output is captured as text."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    variables = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        variables[name] = value
    if not words or words[0] not in PROGRAMS:
        raise ValueError(
            f"run_documented runs the programs {sorted(PROGRAMS)}. Received: "
            f"{command!r}"
        )
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in _JOB_VARIABLES
        and not name.startswith(("KERAS_DIST_", "KERAS_DISTRIBUTION_"))
    }
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), environment.get("PYTHONPATH")])
    )
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environment.update(env or {})
    environment.update(variables)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        link = directory / entry.name
        if not entry.name.startswith(".") and not link.exists():
            link.symlink_to(entry)
    return subprocess.run(
        [*PROGRAMS[words[0]], *words[1:]],
        cwd=directory,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def registered_commands() -> dict[str, str]:
    """Every command a test names through `documented_command` or
    `run_documented` with a literal string, in canonical form, with where
    (`tests/test_x.py:12`)."""
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            function = node.func
            name = getattr(function, "id", None) or getattr(function, "attr", None)
            argument = node.args[0]
            if (
                name in REGISTERING
                and isinstance(argument, ast.Constant)
                and isinstance(argument.value, str)
            ):
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                found.setdefault(canonical(argument.value), where)
    return found
