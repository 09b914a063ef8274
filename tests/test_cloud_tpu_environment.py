"""A Cloud TPU worker's variables: what `kd.initialize()` joins on a slice
(`CloudTpuEnvironment`), one slice or several, and each inconsistency as an
error naming the variables. `tests/test_tpu_pod.py` runs a job of 4 such
workers."""

from __future__ import annotations

import os

import pytest

import keras_dist as kd
from keras_dist import cluster
from keras_dist.backends import get_adapter
from keras_dist.cluster import CloudTpuEnvironment, detect_cluster
from keras_dist.cluster.resolve import resolve_job
from keras_dist.common import job
from keras_dist.runtime import api as runtime

# The same under every backend: run once (tests/conftest.py).
pytestmark = pytest.mark.backend_neutral

HOSTS = "t1v-n-0-w-0,t1v-n-0-w-1,t1v-n-0-w-2,t1v-n-0-w-3"


@pytest.fixture(autouse=True)
def _clean_cluster_environment(monkeypatch):
    for name in list(os.environ):
        if name in cluster.ENVIRONMENT_VARIABLES or name.startswith(
            ("SLURM_", "KERAS_DISTRIBUTION_")
        ):
            monkeypatch.delenv(name)


def _set(monkeypatch, **variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_a_worker_of_one_slice_joins_its_hosts_on_jaxs_port(monkeypatch):
    _set(monkeypatch, TPU_WORKER_HOSTNAMES=HOSTS, TPU_WORKER_ID="2")
    assert isinstance(detect_cluster(), CloudTpuEnvironment)
    assert resolve_job() == (
        "t1v-n-0-w-0:8482",
        4,
        2,
        "TPU_WORKER_HOSTNAMES",
        "TPU_WORKER_ID",
    )


def test_process_addresses_come_first_and_lose_their_ports(monkeypatch):
    _set(
        monkeypatch,
        TPU_PROCESS_ADDRESSES="10.0.0.5:8476,10.0.0.6:8476",
        TPU_WORKER_HOSTNAMES="ignored-0,ignored-1,ignored-2",
        CLOUD_TPU_TASK_ID="1",
    )
    resolved = resolve_job()
    assert resolved.coordinator == "10.0.0.5:8482"
    assert (resolved.count, resolved.rank) == (2, 1)
    assert (resolved.count_source, resolved.rank_source) == (
        "TPU_PROCESS_ADDRESSES",
        "CLOUD_TPU_TASK_ID",
    )


@pytest.mark.parametrize(
    "ports, expected",
    [
        ({"JAX_COORDINATOR_PORT": "9000"}, 9000),
        ({"KERAS_DIST_COORDINATOR_PORT": "9100", "JAX_COORDINATOR_PORT": "9000"}, 9100),
    ],
)
def test_the_port_comes_from_keras_dists_variable_then_jaxs(
    monkeypatch, ports, expected
):
    _set(monkeypatch, TPU_WORKER_HOSTNAMES=HOSTS, TPU_WORKER_ID="0", **ports)
    assert CloudTpuEnvironment().coordinator_address() == f"t1v-n-0-w-0:{expected}"


def test_several_slices_count_hosts_times_slices_as_jax_does(monkeypatch):
    _set(
        monkeypatch,
        TPU_WORKER_HOSTNAMES=HOSTS,
        TPU_WORKER_ID="3",
        MEGASCALE_NUM_SLICES="2",
        MEGASCALE_SLICE_ID="1",
        MEGASCALE_COORDINATOR_ADDRESS="slice-0-host-0:8080",
    )
    resolved = resolve_job()
    assert resolved.coordinator == "slice-0-host-0:8482"
    assert (resolved.count, resolved.rank) == (8, 7)  # 3 + 1 x 4 hosts
    assert resolved.count_source == "TPU_WORKER_HOSTNAMES x MEGASCALE_NUM_SLICES"
    assert resolved.rank_source == "TPU_WORKER_ID + MEGASCALE_SLICE_ID x hosts"


@pytest.mark.parametrize(
    "variables, message",
    [
        (
            {"TPU_WORKER_HOSTNAMES": HOSTS},
            "neither TPU_WORKER_ID nor CLOUD_TPU_TASK_ID is. Received: "
            f"TPU_WORKER_HOSTNAMES='{HOSTS}'",
        ),
        (
            {"TPU_WORKER_HOSTNAMES": HOSTS, "TPU_WORKER_ID": "4"},
            "TPU_WORKER_ID must be in [0, len(TPU_WORKER_HOSTNAMES) - 1]. "
            "Received: TPU_WORKER_ID=4, len(TPU_WORKER_HOSTNAMES)=4",
        ),
        (
            {"TPU_WORKER_HOSTNAMES": "h0,,h2", "TPU_WORKER_ID": "0"},
            "TPU_WORKER_HOSTNAMES must list the slice's hosts separated by "
            "commas, with no empty entry. Received: TPU_WORKER_HOSTNAMES='h0,,h2'",
        ),
        (
            {
                "TPU_WORKER_HOSTNAMES": HOSTS,
                "TPU_WORKER_ID": "0",
                "MEGASCALE_NUM_SLICES": "2",
                "MEGASCALE_SLICE_ID": "2",
            },
            "MEGASCALE_SLICE_ID must be in [0, MEGASCALE_NUM_SLICES - 1]. "
            "Received: MEGASCALE_SLICE_ID=2, MEGASCALE_NUM_SLICES=2",
        ),
        (
            {
                "TPU_WORKER_HOSTNAMES": HOSTS,
                "TPU_WORKER_ID": "0",
                "MEGASCALE_NUM_SLICES": "0",
            },
            "MEGASCALE_NUM_SLICES must be at least 1. Received: MEGASCALE_NUM_SLICES=0",
        ),
        (
            {
                "TPU_WORKER_HOSTNAMES": HOSTS,
                "TPU_WORKER_ID": "0",
                "JAX_COORDINATOR_PORT": "http",
            },
            "JAX_COORDINATOR_PORT must be a port from 1 to 65535. Received: "
            "JAX_COORDINATOR_PORT='http'",
        ),
    ],
)
def test_inconsistent_variables_are_an_error_naming_them(
    monkeypatch, variables, message
):
    _set(monkeypatch, **variables)
    with pytest.raises(ValueError) as error:
        resolve_job()
    assert message in str(error.value)


def test_without_the_hosts_the_slice_is_left_to_jaxs_own_detection(monkeypatch):
    """A TPU VM started with gcloud has its workers in the metadata server,
    which JAX's `jax.distributed.initialize()` asks: keras_dist detects
    nothing and `kd.initialize()` lets the backend's detection run."""
    _set(monkeypatch, TPU_WORKER_ID="1", MEGASCALE_NUM_SLICES="2")
    assert detect_cluster() is None
    assert resolve_job().count == 1


def test_one_host_alone_is_no_job(monkeypatch):
    """`TPU_WORKER_HOSTNAMES=localhost` alone (libtpu's single-host set-up)
    runs one process; a worker id beside it makes it a job."""
    _set(monkeypatch, TPU_WORKER_HOSTNAMES="localhost")
    assert detect_cluster() is None
    assert resolve_job().count == 1
    _set(monkeypatch, TPU_WORKER_ID="0")
    assert isinstance(detect_cluster(), CloudTpuEnvironment)


@pytest.fixture
def worker_two(monkeypatch):
    """Worker 2 of 4 whose script joined through the backend itself first
    (`jax.distributed.initialize()`, as Keras' multi-host guide does): no
    roll call (the backend's coordinator holds its port), no second join."""
    _set(monkeypatch, TPU_WORKER_HOSTNAMES=HOSTS, TPU_WORKER_ID="2")
    monkeypatch.setattr(job, "_joined", {})
    monkeypatch.setattr(job, "_initialize_called", [])

    def must_not_run(*args, **kwargs):
        raise AssertionError("the job was joined already")

    monkeypatch.setattr(runtime, "check_in_everyone", must_not_run)
    monkeypatch.setattr(get_adapter(), "initialize", must_not_run)
    monkeypatch.setattr(runtime.lifecycle, "install", lambda rank: None)
    return monkeypatch


def test_a_job_the_backend_joined_first_is_taken_as_it_is(worker_two):
    worker_two.setattr(get_adapter(), "joined_on_its_own", lambda: (4, 2))
    kd.initialize()
    assert job.joined() == {
        "coordinator": f"joined by {get_adapter().name}",
        "count": 4,
        "rank": 2,
    }
    assert job.initialize_called()


def test_a_job_the_backend_joined_first_must_be_the_same_one(worker_two):
    worker_two.setattr(get_adapter(), "joined_on_its_own", lambda: (4, 1))
    with pytest.raises(ValueError) as error:
        kd.initialize()
    assert (
        f"The {get_adapter().name} backend already joined a job as process 1 of 4 "
        "(the script initialized it itself), but keras_dist found process 2 of 4"
    ) in str(error.value)
    assert job.joined() == {}


@pytest.mark.backend("jax")
def test_jax_says_whether_the_script_joined_through_it_first(monkeypatch):
    import jax

    adapter = get_adapter()
    assert adapter.joined_on_its_own() is None  # this test process joined none
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert adapter.joined_on_its_own() == (jax.process_count(), jax.process_index())
