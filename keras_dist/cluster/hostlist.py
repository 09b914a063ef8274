"""SLURM host lists (`node[01-04],gpu7`): standard library only, and no
import of keras_dist either, so a stand-in `scontrol` can load this file alone."""

from __future__ import annotations

import itertools
import re


# -- SLURM host lists -----------------------------------------------------------
def expand_hostlist(nodelist: str, *, name: str = "nodelist") -> list[str]:
    """Every host of a SLURM host list, in order.

    Handles comma-separated items, bracketed ranges and lists (`node[01-03,07]`
    keeps the zero padding of the lower bound) and several bracket groups in one
    name (`rack[1-2]-node[1-2]`, expanded left to right).

    Args:
        nodelist: the compressed list, e.g. `SLURM_JOB_NODELIST`.
        name: what to call the list in errors (the variable it came from).

    Returns:
        The host names.

    Example:

    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist, name):
        hosts.extend(_expand_host_pattern(item, nodelist, name))
    return hosts


def _bad_hostlist(nodelist: str, name: str, why: str) -> ValueError:
    return ValueError(
        f"{name} is not a SLURM host list ({why}); expected e.g. "
        f"'node[01-03,07],gpu5'. Received: {name}={nodelist!r}"
    )


def _split_outside_brackets(nodelist: str, name: str) -> list[str]:
    items, current, depth = [], [], 0
    for character in nodelist.strip():
        if character == "[":
            depth += 1
            if depth > 1:
                raise _bad_hostlist(nodelist, name, "nested '['")
        elif character == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(nodelist, name, "']' without '['")
        if character == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(character)
    if depth:
        raise _bad_hostlist(nodelist, name, "'[' without ']'")
    items.append("".join(current))
    if any(not item for item in items):
        raise _bad_hostlist(nodelist, name, "an empty host name")
    return items


def _expand_host_pattern(item: str, nodelist: str, name: str) -> list[str]:
    # re.split with a capturing group alternates literal text and "[...]" groups.
    parts = re.split(r"(\[[^\]]*\])", item)
    choices = [
        _expand_range_group(part[1:-1], nodelist, name)
        if part.startswith("[")
        else [part]
        for part in parts
    ]
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_range_group(group: str, nodelist: str, name: str) -> list[str]:
    values: list[str] = []
    for span in group.split(","):
        low, _, high = span.partition("-")
        high = high or low
        if not (re.fullmatch("[0-9]+", low) and re.fullmatch("[0-9]+", high)):
            raise _bad_hostlist(nodelist, name, f"[{group}] is not a list of numbers")
        if int(low) > int(high):
            raise _bad_hostlist(nodelist, name, f"the range {span} runs backwards")
        values.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return values
