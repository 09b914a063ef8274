"""A griffe extension for the API reference: doctests become code blocks.

Some of keras_dist's docstrings show their example as a doctest right under an
`Example:` heading (`>>> ...` lines and their output, not indented). griffe's
Google parser reads those lines as Markdown text: `>>>` turns into nested
quotes, and an output such as `[0.0, 0.1]` reads as a Markdown link, which
`mkdocs build --strict` rejects. This extension fences each run of doctest
lines outside a fenced block as a `pycon` code block, before griffe parses the
docstring; the docstrings themselves stay as they are.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """`text` with every run of doctest lines (from a `>>>` line to the next
    blank line) outside a fenced block put in a ```pycon block."""
    lines = text.split("\n")
    result: list[str] = []
    in_fence = False
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_fence or not stripped.startswith(">>>"):
            result.append(line)
            index += 1
            continue
        indent = line[: len(line) - len(stripped)]
        result.append(f"{indent}```pycon")
        while index < len(lines) and lines[index].strip():
            if lines[index].lstrip().startswith("```"):
                break
            result.append(lines[index])
            index += 1
        result.append(f"{indent}```")
    return "\n".join(result)


class FenceDoctests(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and ">>>" in docstring.value:
            docstring.value = fence_doctests(docstring.value)
