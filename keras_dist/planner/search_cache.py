"""`keras_dist.plan_search`'s cache: a compiled candidate as one JSON file,
named by a fingerprint of everything its program depends on.

    model        each variable's path, shape and dtype, in order, and each
                 layer's class and config (Keras' automatic name suffixes,
                 `dense_3`, and object addresses left out, so that the same
                 model made again has the same fingerprint)
    compile      the optimizer's class and config, the loss, the dtype policy
    candidate    policy, mesh, remat
    job          topology, slices, batch size, sequence length, input shape,
                 target shape, steps compiled
    versions     keras_dist, keras, jax, jaxlib, libtpu

The figures are XLA's, whatever the devices' memory: whether a cached
candidate fits is decided again from the memory of each search.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import tempfile
from typing import Any

import keras

from keras_dist._version import __version__
from keras_dist.keras_compat.layers import layers_of
from keras_dist.planner.result import CompiledPlan, CompiledStep, Problem

# 2: collectives count what crosses slices ("cross-slice"), and the network
# term is theirs; entries of 1 are compiled again.
FORMAT = 2
_SUFFIX = re.compile(r"_\d+$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NAME_KEYS = ("name",)


def default_cache_dir() -> pathlib.Path:
    """`$XDG_CACHE_HOME/keras_dist/plans`, else `~/.cache/keras_dist/plans`:
    where `plan_search(..., cache_dir=True)` keeps its results."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(root).expanduser() / "keras_dist" / "plans"


def _plain(value: Any) -> str:
    return _ADDRESS.sub("", repr(value))


def _without_names(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: _without_names(item)
            for key, item in value.items()
            if key not in _NAME_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_without_names(item) for item in value]
    return value


def _config(thing: Any) -> Any:
    """`thing`'s class and config without names, or its class alone when it
    has no config that can be read (a variable without a value, say)."""
    kind = f"{type(thing).__module__}.{type(thing).__qualname__}"
    try:
        config = _without_names(thing.get_config())
    except Exception:  # any get_config: the class then stands for it
        config = None
    return [kind, config]


def _path(path: str) -> str:
    return "/".join(_SUFFIX.sub("", part) for part in path.split("/"))


def model_fingerprint(model: Any) -> dict[str, Any]:
    """What the compiled program of `model` depends on, JSON-ready."""
    loss = getattr(model, "loss", None)
    optimizer = getattr(model, "optimizer", None)
    return {
        "variables": [
            [_path(v.path), list(v.shape), str(v.dtype)] for v in model.variables
        ],
        "layers": [_config(layer) for layer in layers_of(model)[1:]],
        "optimizer": None if optimizer is None else _config(optimizer),
        "loss": [
            _config(item) if hasattr(item, "get_config") else _plain(item)
            for item in keras.tree.flatten(loss)
        ]
        if loss is not None
        else None,
        "dtype_policy": str(getattr(model.dtype_policy, "name", model.dtype_policy)),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "keras_dist": __version__,
        "keras": keras.__version__,
        **{name: _version(name) for name in ("jax", "jaxlib", "libtpu")},
    }


def cache_key(model_part: dict[str, Any], job: dict[str, Any], candidate: Any) -> str:
    """The fingerprint of one candidate of one search: a hex digest."""
    text = json.dumps(
        {
            "format": FORMAT,
            "model": model_part,
            "job": job,
            "candidate": candidate.to_dict(),
            "versions": versions(),
        },
        sort_keys=True,
        default=_plain,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def compiled_to_dict(compiled: CompiledPlan) -> dict[str, Any]:
    return {
        "topology": compiled.topology,
        "device_kind": compiled.device_kind,
        "devices": compiled.devices,
        "num_slices": compiled.num_slices,
        "slice_axis": compiled.slice_axis,
        "compute_dtype": compiled.compute_dtype,
        "steps": {kind: dict(step.__dict__) for kind, step in compiled.steps.items()},
        "notes": list(compiled.notes),
    }


def compiled_from_dict(data: dict[str, Any], memory: int | None) -> CompiledPlan:
    return CompiledPlan(
        data["topology"],
        data["device_kind"],
        int(data["devices"]),
        int(data["num_slices"]),
        data["compute_dtype"],
        {kind: CompiledStep(**step) for kind, step in data["steps"].items()},
        memory,
        list(data["notes"]),
        data.get("slice_axis"),
    )


class SearchCache:
    """Compiled candidates as JSON files in `directory`, one per key."""

    def __init__(self, directory: Any):
        self.directory = pathlib.Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry stored under `key`, or None (absent or unreadable: it
        is compiled again and overwritten)."""
        try:
            entry = json.loads(self._file(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        return entry

    def store(
        self,
        key: str,
        compiled: CompiledPlan,
        chip_memory: int | None,
        problems: list[Problem],
        warnings: list[str],
        description: dict[str, Any],
    ) -> None:
        entry = {
            "format": FORMAT,
            "description": description,
            "chip_memory": chip_memory,
            "compiled": compiled_to_dict(compiled),
            "problems": [
                {"kind": p.kind, "message": p.message, "paths": list(p.paths)}
                for p in problems
            ],
            "warnings": list(warnings),
        }
        # Written whole or not at all: another search may read it meanwhile.
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".part")
        with os.fdopen(handle, "w") as file:
            json.dump(entry, file, default=_plain)
        os.replace(temporary, self._file(key))


def entry_problems(entry: dict[str, Any]) -> list[Problem]:
    return [
        Problem(p["kind"], p["message"], tuple(p["paths"]))
        for p in entry.get("problems", [])
    ]


__all__ = [
    "SearchCache",
    "cache_key",
    "compiled_from_dict",
    "compiled_to_dict",
    "default_cache_dir",
    "entry_problems",
    "model_fingerprint",
    "versions",
]
