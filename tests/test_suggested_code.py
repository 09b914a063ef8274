"""Code an error message hands the user is accepted as handed.

Every string of keras_dist's functions (docstrings aside) that names a call
of `kd.`, `keras_dist.` or `keras.` (`kd.DeviceMesh((2, 4), ['batch',
'seq'])`, `keras.RematScope(mode=...)`, `kd.initialize()`...) is found in
the source. A call written out whole in the source is checked from there;
one completed with values at run time (an axis name the user gave) is
checked in the message the refusal really raises (`RUN_TIME`). Each call is
resolved, its arguments bound to the callable's signature (`...` and names
such as `model_function` stand for what the user supplies), and, where all
its arguments are given and calling it does nothing beyond making an object
(no job joined, no seed set), made."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import keras
import pytest

import keras_dist as kd

ROOT = Path(kd.__file__).parent
CALL = re.compile(r"(?:\bkd|\bkeras_dist|\bkeras)\.[A-Za-z_][\w.]*\(")
# What the test does not call: it joins a job or changes global state.
NOT_CALLED = {"initialize", "set_random_seed", "plan", "plan_search"}
# Where the strings are for the command line's help, not an error.
NOT_ERRORS = ("cli.py", "cli_plan.py", "cli_search.py")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _text(node: ast.AST) -> str | None:
    """A string literal's text, each value filled in at run time as `\\0`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            part.value if isinstance(part, ast.Constant) else "\0"
            for part in node.values
        )
    return None


def _calls(text: str) -> list[str]:
    """Each call in `text` from its name to its balanced closing parenthesis
    (to the end of `text` and `\\0` when it does not close there: the rest
    is another string, completed at run time)."""
    found = []
    for match in CALL.finditer(text):
        depth, end, quote = 0, len(text), None
        for index in range(match.end() - 1, len(text)):
            char = text[index]
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char in "([{":
                depth += 1
            elif char in ")]}":
                depth -= 1
                if depth == 0:
                    end = index + 1
                    break
        found.append(text[match.start() : end] + ("" if depth == 0 else "\0"))
    return found


def _sites() -> dict[str, list[str]]:
    """Each function whose strings suggest code ("path:function"), with the
    calls its strings write out."""
    sites: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.name in NOT_ERRORS:
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if path.parent.name == "keras_compat" and function.name == "check":
                continue  # the probe's names of Keras internals
            parts = {
                id(part)
                for node in ast.walk(function)
                if isinstance(node, ast.JoinedStr)
                for part in node.values
            }
            for node in ast.walk(function):
                text = _text(node)
                if text is None or id(node) in docstrings | parts:
                    continue
                calls = _calls(text)
                if calls:
                    site = f"{path.relative_to(ROOT)}:{function.name}"
                    sites.setdefault(site, [])
                    sites[site] += [c for c in calls if c not in sites[site]]
    return sites


class _Supplied:
    """What a placeholder (`...`, `model_function`) stands for."""


def _arguments(call: ast.Call) -> tuple[list, dict, bool]:
    """The call's arguments as values, and whether any is a placeholder."""
    supplied = False

    def value(node: ast.AST):
        nonlocal supplied
        try:
            literal = ast.literal_eval(node)
        except ValueError:
            supplied = True
            return _Supplied()
        if literal is Ellipsis or (
            isinstance(literal, (list, tuple)) and Ellipsis in literal
        ):
            supplied = True
        return literal

    args = [value(arg) for arg in call.args]
    kwargs = {keyword.arg: value(keyword.value) for keyword in call.keywords}
    return args, kwargs, supplied


def _accepted(code: str) -> None:
    """Resolve the call `code`, bind its arguments, and make it where it
    only makes an object; raises what the user would meet."""
    call = ast.parse(code, mode="eval").body
    assert isinstance(call, ast.Call), code
    function = eval(  # the callable's dotted name only
        compile(ast.Expression(call.func), "<suggested>", "eval"),
        {"kd": kd, "keras_dist": kd, "keras": keras},
    )
    args, kwargs, supplied = _arguments(call)
    inspect.signature(function).bind(*args, **kwargs)
    if not supplied and function.__name__ not in NOT_CALLED:
        function(*args, **kwargs)


def _refusal(make) -> str:
    with pytest.raises((ValueError, TypeError)) as error:
        make()
    return str(error.value)


def _mesh():
    return kd.DeviceMesh((2, 4), ["batch", "seq"])


# The functions whose suggested calls are completed at run time: the
# messages they raise, for each way they can be completed.
RUN_TIME = {
    "distribution/sequence.py:check_sequence_axis": [
        lambda: kd.DataParallel(_mesh(), sequence_axis="batch"),
        lambda: kd.FSDP(_mesh(), sequence_axis="batch"),
        lambda: kd.DataParallel(_mesh(), sequence_axis="sequence"),
        lambda: kd.FSDP(
            kd.DeviceMesh((2, 4), ["data", "model"]), axis="data", sequence_axis="batch"
        ),
        lambda: kd.DataParallel(
            kd.DeviceMesh((4, 2), ["seq", "batch"]), sequence_axis="seq"
        ),
    ],
}


def _pinned_codes() -> list[str]:
    from keras_dist.planner.auto_choice import pinned_code
    from keras_dist.planner.candidates import Candidate

    return [
        pinned_code(candidate)
        for candidate in (
            Candidate("data_parallel", {"batch": 8}),
            Candidate("fsdp", {"batch": 8}, remat="dots", offload="optimizer"),
            Candidate("fsdp", {"batch": 2, "seq": 4}),
            Candidate("fsdp_tp", {"batch": 4, "model": 2}, remat="full"),
            Candidate("data_parallel", {"batch": 8}, optimizer_state_dtype="bfloat16"),
        )
    ]


# The functions that write code whole at run time (not in an error): the code
# they write for each kind of candidate, run as the user would paste it.
WRITTEN = {"planner/auto_choice.py:pinned_code": _pinned_codes}


@pytest.mark.backend("jax")
def test_every_call_an_error_message_suggests_is_accepted():
    sites = _sites()
    assert len(sites) >= 15, sorted(sites)  # the scan finds them
    for site, calls in sites.items():
        for code in calls:
            if "\0" in code:
                assert site in RUN_TIME or site in WRITTEN, (
                    f"{site}: {code!r} is completed at run time"
                )
                continue
            try:
                _accepted(code)
            except Exception as error:
                raise AssertionError(f"{site} suggests {code!r}: {error!r}") from error
    assert set(RUN_TIME) | set(WRITTEN) <= set(sites)


@pytest.mark.backend("jax")
@pytest.mark.parametrize("site", list(WRITTEN))
def test_code_written_at_run_time_runs_as_pasted(site):
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(4)]
    )
    for code in WRITTEN[site]():
        try:
            made = eval(  # the distribution is the statement's last value
                compile(ast.parse(code.rsplit("; ", 1)[-1], mode="eval"), site, "eval"),
                _executed(code, {"kd": kd, "keras": keras, "model": model}),
            )
        except Exception as error:
            raise AssertionError(f"{site} writes {code!r}: {error!r}") from error
        assert isinstance(made, kd.Distribution), code


def _executed(code: str, namespace: dict) -> dict:
    """`namespace` after the statements before `code`'s last one."""
    head, _, _ = code.rpartition("; ")
    if head:
        exec(head, namespace)
    return namespace


@pytest.mark.backend("jax")
@pytest.mark.filterwarnings("ignore:DataParallel splits the batch:UserWarning")
@pytest.mark.parametrize("site", list(RUN_TIME))
def test_calls_completed_at_run_time_are_accepted_in_the_raised_message(site):
    for make in RUN_TIME[site]:
        message = _refusal(make)
        calls = _calls(message)
        assert calls, message
        for code in calls:
            try:
                _accepted(code)
            except Exception as error:
                raise AssertionError(f"{message}\n{code!r}: {error!r}") from error
