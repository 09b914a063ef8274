"""torchrun and the launchers that imitate it (`RANK`, `WORLD_SIZE`, ...)."""

from __future__ import annotations

import os

from keras_dist.cluster.addresses import join_address
from keras_dist.cluster.environments.base import (
    TORCHRUN_VARIABLES,
    ClusterEnvironment,
    at_least_one,
    environment_int,
    environment_value,
    port_variable,
    rank_in_range,
)


class TorchrunEnvironment(ClusterEnvironment):
    """torchrun (`torch.distributed.run`) and launchers that imitate it.

    Detected when `RANK` or `WORLD_SIZE` is set; then `RANK`, `WORLD_SIZE`,
    `MASTER_ADDR` and `MASTER_PORT` must all be. `MASTER_ADDR`/`MASTER_PORT`
    alone are not enough: batch scripts often export them for other tools.
    """

    num_processes_source = "WORLD_SIZE"
    process_id_source = "RANK"
    variables = (*TORCHRUN_VARIABLES, "LOCAL_RANK")

    @staticmethod
    def detect() -> bool:
        return any(environment_value(name) for name in ("RANK", "WORLD_SIZE"))

    def _required(self, name: str) -> str:
        missing = [key for key in TORCHRUN_VARIABLES if environment_value(key) is None]
        if missing:
            present = ", ".join(
                f"{key}={os.environ[key]!r}"
                for key in TORCHRUN_VARIABLES
                if key not in missing
            )
            raise ValueError(
                "torchrun-style variables are incomplete: "
                f"{', '.join(TORCHRUN_VARIABLES)} must all be set, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                f"missing. Received: {present}"
            )
        return os.environ[name].strip()

    def coordinator_address(self) -> str:
        host = self._required("MASTER_ADDR")
        port = port_variable("MASTER_PORT", self._required("MASTER_PORT"))
        return join_address(host, port)

    def num_processes(self) -> int:
        self._required("WORLD_SIZE")
        return at_least_one("WORLD_SIZE", environment_int("WORLD_SIZE"))

    def process_id(self) -> int:
        self._required("RANK")
        return rank_in_range(
            "RANK", environment_int("RANK"), "WORLD_SIZE", self.num_processes()
        )

    def local_process_id(self) -> int | None:
        local_rank = environment_int("LOCAL_RANK")
        if local_rank is not None and local_rank < 0:
            raise ValueError(
                f"LOCAL_RANK must not be negative. Received: LOCAL_RANK={local_rank}"
            )
        return local_rank
