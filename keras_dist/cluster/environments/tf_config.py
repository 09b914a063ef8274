"""TensorFlow clusters: the `TF_CONFIG` JSON (Kubeflow TFJob, Vertex AI)."""

from __future__ import annotations

import json

from keras_dist.cluster.addresses import split_address
from keras_dist.cluster.environments.base import (
    TF_CONFIG_TASK_TYPES,
    ClusterEnvironment,
    environment_value,
)


class TFConfigEnvironment(ClusterEnvironment):
    """A TensorFlow cluster described by `TF_CONFIG`.

    `TF_CONFIG` is JSON such as
    `{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
    "task": {"type": "worker", "index": 0}}`. The chief (when there is one)
    is process 0 and the coordinator, then the workers in order; other task
    types (`ps`, `evaluator`) are not part of a synchronous job and are an
    error.
    """

    num_processes_source = "TF_CONFIG"
    process_id_source = "TF_CONFIG"
    variables = ("TF_CONFIG",)

    @staticmethod
    def detect() -> bool:
        return environment_value("TF_CONFIG") is not None

    def _invalid(self, why: str) -> ValueError:
        raw = environment_value("TF_CONFIG")
        return ValueError(f"TF_CONFIG {why}. Received: TF_CONFIG={raw!r}")

    def _config(self) -> tuple[dict[str, list[str]], object]:
        """`TF_CONFIG`'s chief and worker address lists, and its task entry."""
        try:
            config = json.loads(environment_value("TF_CONFIG") or "")
        except json.JSONDecodeError as error:
            raise self._invalid(f"is not valid JSON ({error})") from None
        cluster = config.get("cluster") if isinstance(config, dict) else None
        if not isinstance(cluster, dict):
            raise self._invalid("must be a JSON object with a 'cluster' object")
        lists: dict[str, list[str]] = {}
        for task_type in TF_CONFIG_TASK_TYPES:
            entries = cluster.get(task_type, [])
            if not isinstance(entries, list) or not all(
                isinstance(entry, str) for entry in entries
            ):
                raise self._invalid(
                    f"cluster.{task_type} must be a list of 'host:port' strings"
                )
            for entry in entries:
                try:
                    split_address(entry)
                except ValueError:
                    raise self._invalid(
                        f"cluster.{task_type} holds {entry!r}, not a 'host:port'"
                    ) from None
            lists[task_type] = entries
        if len(lists["chief"]) > 1:
            raise self._invalid("lists more than one cluster.chief")
        if not lists["chief"] and not lists["worker"]:
            raise self._invalid("lists no cluster.chief or cluster.worker addresses")
        return lists, config.get("task")

    def coordinator_address(self) -> str:
        lists, _ = self._config()
        return (lists["chief"] + lists["worker"])[0]

    def num_processes(self) -> int:
        lists, _ = self._config()
        return len(lists["chief"]) + len(lists["worker"])

    def tasks(self) -> list[tuple[str, int, str]]:
        """`(task type, index, "host:port")` of every process, in rank order."""
        lists, _ = self._config()
        return [
            (task_type, index, address)
            for task_type in TF_CONFIG_TASK_TYPES
            for index, address in enumerate(lists[task_type])
        ]

    def process_id(self) -> int:
        lists, task = self._config()
        if not isinstance(task, dict):
            raise self._invalid("needs a 'task' object with 'type' and 'index'")
        task_type, index = task.get("type"), task.get("index")
        if task_type not in TF_CONFIG_TASK_TYPES:
            raise self._invalid(
                f"task.type must be one of {list(TF_CONFIG_TASK_TYPES)} "
                f"(keras_dist runs synchronous workers); got {task_type!r}"
            )
        if isinstance(index, bool) or not isinstance(index, int):
            raise self._invalid(f"task.index must be an int; got {index!r}")
        listed = len(lists[task_type])
        if not 0 <= index < listed:
            raise self._invalid(
                f"task.index={index} is out of range: cluster.{task_type} lists "
                f"{listed} address(es)"
            )
        # The chief, when there is one, is process 0; the workers follow it.
        return index if task_type == "chief" else len(lists["chief"]) + index
