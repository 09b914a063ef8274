"""The Kubernetes manifests of `integrations/kubernetes/`.

There is no Kubernetes here. The tests
- validate every manifest: the custom resources (Kubeflow Trainer's
  TrainingRuntime and TrainJob, JobSet) against the `openAPIV3Schema` of the
  projects' published CRDs (`schemas/`, see its README) with `jsonschema`,
  strictly (an unknown field is an error, as `kubectl apply
  --validate=strict` makes it), and the pod templates inside them against
  Kubernetes' own schemas with kubernetes-validate;
- compute the environment of each pod from the manifest: its `env` entries,
  with `fieldRef`s read from the annotations the controller puts on the pod,
  plus the variables the Kubeflow runtime's plugin injects (ported from
  kubeflow/trainer v2.3.0 `pkg/runtime/framework/plugins/{torch,jax}`, and
  jobset v0.12.0 `labelAndAnnotateObject`);
- start the manifest's command in 2 local processes with that environment
  and check that `kd.initialize()` forms the job and trains as one process.
  Two things stand in for the cluster: the coordinator's host name (cluster
  DNS) becomes 127.0.0.1, and its port a free one.
Not tested: a real cluster, the controllers and their webhooks (CEL rules
`x-kubernetes-validations` are not evaluated), scheduling, GPUs.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import yaml

from keras_dist import cluster
from keras_dist.cluster import find_free_port
from tests.multiprocess import WORKERS, wait_then_clean_up
from tests.workers import cluster_scenario

# Backend-neutral: one backend runs them, except the JAX runtime's job.
pytestmark = pytest.mark.backend("torch")

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
MANIFESTS = REPOSITORY / "integrations" / "kubernetes"
SCHEMAS = pathlib.Path(__file__).parent / "schemas"
KUBERNETES_VERSION = "1.33"  # kubernetes-validate's schemas of that release
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# kubeflow/trainer pkg/constants: the trainer node's name and port.
TRAINER_NODE, TRAINER_PORT = "node", 29500


def documents(name: str) -> list[dict]:
    with open(MANIFESTS / name) as file:
        return [doc for doc in yaml.safe_load_all(file) if doc]


def by_kind(name: str, kind: str) -> dict:
    (document,) = [doc for doc in documents(name) if doc["kind"] == kind]
    return document


# -- validation ------------------------------------------------------------------
def strict(schema: object) -> object:
    """The schema with unknown fields forbidden where it lists the fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key == "properties":  # field names, not schema keywords
            result[key] = {name: strict(sub) for name, sub in value.items()}
        else:
            result[key] = strict(value)
    preserves_unknown = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not preserves_unknown:
        result.setdefault("additionalProperties", False)
    return result


CRD_SCHEMAS = {
    (data["group"], data["version"], data["kind"]): data
    for data in (
        json.loads(path.read_text()) for path in sorted(SCHEMAS.glob("*.json"))
    )
}


@functools.cache
def crd_validator(group: str, version: str, kind: str) -> jsonschema.Validator:
    schema = strict(CRD_SCHEMAS[(group, version, kind)]["openAPIV3Schema"])
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def pod_specs(document: dict) -> list[dict]:
    """Every pod spec of a TrainingRuntime or JobSet: what the vendored CRD
    schemas leave to kubernetes-validate."""
    spec = document["spec"]
    jobs = spec["template"]["spec"] if document["kind"] == "TrainingRuntime" else spec
    return [
        job["template"]["spec"]["template"]["spec"] for job in jobs["replicatedJobs"]
    ]


def validate(document: dict) -> None:
    group, _, version = document["apiVersion"].rpartition("/")
    crd_validator(group, version, document["kind"]).validate(document)
    if document["kind"] == "TrainJob":
        return  # no pod template: the runtime holds it
    for pod_spec in pod_specs(document):
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "template"},
                "template": {"spec": pod_spec},
            },
            KUBERNETES_VERSION,
            strict=True,
        )


MANIFEST_KINDS = {
    "kubeflow-torch.yaml": ["TrainingRuntime", "TrainJob"],
    "kubeflow-jax.yaml": ["TrainingRuntime", "TrainJob"],
    "jobset.yaml": ["JobSet"],
}


@pytest.mark.parametrize("name", sorted(MANIFEST_KINDS))
def test_manifests_validate_against_the_published_schemas(name):
    docs = documents(name)
    assert [doc["kind"] for doc in docs] == MANIFEST_KINDS[name]
    for document in docs:
        validate(document)


def test_every_manifest_is_tested():
    assert sorted(path.name for path in MANIFESTS.glob("*.yaml")) == sorted(
        MANIFEST_KINDS
    )


@pytest.mark.parametrize(
    ("name", "kind", "path", "value", "complaint"),
    [
        ("kubeflow-torch.yaml", "TrainJob", ["spec", "trainer", "numNodes"], "2", ""),
        ("kubeflow-torch.yaml", "TrainJob", ["spec", "trainer", "nodes"], 2, ""),
        ("jobset.yaml", "JobSet", ["spec", "coordinator", "replicatedJob"], 0, ""),
        (
            "jobset.yaml",
            "JobSet",
            ["spec", "replicatedJobs", 0, "template", "spec", "template", "spec"]
            + ["containers", 0, "env", 0, "value"],
            7,
            "pod",
        ),
    ],
    ids=["wrong-type", "unknown-field", "coordinator-type", "pod-env-type"],
)
def test_validation_rejects_a_broken_manifest(name, kind, path, value, complaint):
    document = copy.deepcopy(by_kind(name, kind))
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    error = (
        kubernetes_validate.ValidationError
        if complaint == "pod"
        else jsonschema.ValidationError
    )
    with pytest.raises(error):
        validate(document)


# -- the environment each pod gets -------------------------------------------------
def field_value(field_path: str, annotations: dict[str, str]) -> str:
    match = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", field_path)
    assert match, f"unsupported fieldRef {field_path}"
    return annotations[match.group(1)]


def resolve(entries: list[dict], annotations: dict[str, str]) -> dict[str, str]:
    """A container's `env` list as the kubelet resolves it."""
    env = {}
    for entry in entries:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            field_path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            env[entry["name"]] = field_value(field_path, annotations)
    return env


def trainjob_pods(name: str) -> list[tuple[list[str], dict[str, str]]]:
    """`(command, environment)` of each trainer pod of the manifest's
    TrainJob, as Kubeflow Trainer v2.3.0 makes them: the runtime's container
    env, then the TrainJob's trainer env, then the ML policy's variables."""
    runtime, job = by_kind(name, "TrainingRuntime"), by_kind(name, "TrainJob")
    trainer = job["spec"]["trainer"]
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    policy = runtime["spec"]["mlPolicy"]
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    coordinator_host = f"{job['metadata']['name']}-{TRAINER_NODE}-0-0"
    coordinator_host += f".{job['metadata']['name']}"
    pods = []
    for index in range(nodes):
        annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
        env = resolve(container.get("env", []), annotations)
        env.update(resolve(trainer.get("env", []), annotations))
        if "torch" in policy:  # plugins/torch/torch.go EnforceMLPolicy
            env.update(
                PET_NNODES=str(nodes),
                PET_NPROC_PER_NODE=str(trainer.get("numProcPerNode", "auto")),
                PET_NODE_RANK=field_value(COMPLETION_INDEX, annotations),
                PET_MASTER_ADDR=coordinator_host,
                PET_MASTER_PORT=str(TRAINER_PORT),
            )
        if "jax" in policy:  # plugins/jax/jax.go EnforceMLPolicy
            env.update(
                JAX_NUM_PROCESSES=str(nodes),
                JAX_PROCESS_ID=field_value(COMPLETION_INDEX, annotations),
                JAX_COORDINATOR_ADDRESS=f"{coordinator_host}:{TRAINER_PORT}",
            )
        env["JOB_COMPLETION_INDEX"] = str(index)  # Kubernetes, Indexed Jobs
        pods.append((trainer["command"] + trainer.get("args", []), env))
    return pods


def jobset_pods(name: str) -> list[tuple[list[str], dict[str, str]]]:
    """`(command, environment)` of each pod of the manifest's JobSet, with the
    annotations JobSet v0.12.0 puts on them (`labelAndAnnotateObject`,
    `CoordinatorEndpoint`)."""
    jobset = by_kind(name, "JobSet")
    spec = jobset["spec"]
    subdomain = spec.get("network", {}).get("subdomain", jobset["metadata"]["name"])
    coordinator = spec["coordinator"]
    endpoint = (
        f"{jobset['metadata']['name']}-{coordinator['replicatedJob']}-"
        f"{coordinator.get('jobIndex', 0)}-{coordinator.get('podIndex', 0)}.{subdomain}"
    )
    total = sum(job.get("replicas", 1) for job in spec["replicatedJobs"])
    pods, global_index = [], 0
    for replicated in spec["replicatedJobs"]:
        job_spec = replicated["template"]["spec"]
        (container,) = job_spec["template"]["spec"]["containers"]
        for job_index in range(replicated.get("replicas", 1)):
            for pod_index in range(job_spec.get("parallelism", 1)):
                annotations = {
                    "jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"],
                    "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                    "jobset.sigs.k8s.io/job-index": str(job_index),
                    "jobset.sigs.k8s.io/job-global-index": str(global_index),
                    "jobset.sigs.k8s.io/global-replicas": str(total),
                    "jobset.sigs.k8s.io/coordinator": endpoint,
                    "batch.kubernetes.io/job-completion-index": str(pod_index),
                }
                env = resolve(container.get("env", []), annotations)
                env["JOB_COMPLETION_INDEX"] = str(pod_index)
                pods.append((container["command"], env))
            global_index += 1
    return pods


def test_the_torch_runtime_pods_get_the_pet_variables():
    (_, first), (_, second) = trainjob_pods("kubeflow-torch.yaml")
    assert second["PET_NODE_RANK"] == "1" and second["PET_NNODES"] == "2"
    assert second["PET_MASTER_ADDR"] == "keras-dist-torch-node-0-0.keras-dist-torch"
    assert first["PET_NPROC_PER_NODE"] == "1"  # one process per pod


def test_the_jobset_pods_get_their_place_from_the_annotations():
    (_, first), (_, second) = jobset_pods("jobset.yaml")
    assert first["JOBSET_COORDINATOR"] == "keras-dist-workers-0-0.keras-dist"
    assert [first["JOBSET_JOB_GLOBAL_INDEX"], second["JOBSET_JOB_GLOBAL_INDEX"]] == [
        "0",
        "1",
    ]
    assert second["JOBSET_GLOBAL_REPLICAS"] == "2"


# -- those environments form a job and train ----------------------------------------
def local(env: dict[str, str], port: int) -> dict[str, str]:
    """The pod's environment on this machine: the coordinator's host name is
    127.0.0.1 (no cluster DNS here) and its port a free one."""
    env = dict(env)
    for name in ("PET_MASTER_ADDR", "JOBSET_COORDINATOR"):
        if name in env:
            env[name] = "127.0.0.1"
    for name in ("PET_MASTER_PORT", "KERAS_DIST_COORDINATOR_PORT"):
        if name in env:
            env[name] = str(port)
    if "JAX_COORDINATOR_ADDRESS" in env:
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    return env


PORT_TAKEN = "is already in use on this host"


def run_pods(pods, tmp_path: pathlib.Path) -> list[dict]:
    """Each pod's command, its script replaced by the worker, as a local
    process with the pod's environment; their results. A free port can be
    taken by another test's job before process 0 listens there (the
    coordinator then says so): the job runs again on another one."""
    for attempt in range(3):
        children = _start_pods(pods, tmp_path, find_free_port())
        wait_then_clean_up(children, 180)
        logs = [(tmp_path / f"log-{i}.txt").read_text() for i in range(len(pods))]
        if attempt < 2 and any(PORT_TAKEN in log for log in logs):
            continue
        break
    for index, (child, _) in enumerate(children):
        assert child.returncode == 0, logs[index][-4000:]
    return [
        json.loads((tmp_path / f"result-{rank}.json").read_text())
        for rank in range(len(pods))
    ]


def _start_pods(pods, tmp_path: pathlib.Path, port: int) -> list:
    base = {
        name: value
        for name, value in os.environ.items()
        if not (
            name in cluster.ENVIRONMENT_VARIABLES
            or name.startswith(("SLURM_", "KERAS_DIST", "PET_", "JAX_", "JOBSET_"))
        )
    }
    base["KERAS_DIST_INIT_TIMEOUT"] = "60"
    children = []
    for index, (command, pod_env) in enumerate(pods):
        assert command[0] == "python" and command[1].endswith("train.py"), command
        env = {**base, **local(pod_env, port)}
        if env["KERAS_BACKEND"] != "torch":
            env["KERAS_DIST_CPU_DEVICES"] = "1"
        log = open(tmp_path / f"log-{index}.txt", "w")
        argv = [sys.executable, str(WORKERS / "cluster_worker.py"), str(tmp_path)]
        children.append((subprocess.Popen(argv, env=env, stdout=log, stderr=log), log))
    return children


@pytest.fixture(scope="module")
def one_process_weights():
    return cluster_scenario.train(None)


def assert_job(results: list[dict], detected: str, expected: list) -> None:
    assert [(r["processes"], r["rank"]) for r in results] == [(2, 0), (2, 1)]
    assert [r["detected"] for r in results] == [detected] * 2
    for result in results:
        for ours, reference in zip(result["weights"], expected, strict=True):
            np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)


def test_the_torch_trainjob_pods_form_the_job_and_train(tmp_path, one_process_weights):
    pods = trainjob_pods("kubeflow-torch.yaml")
    assert {env["KERAS_BACKEND"] for _, env in pods} == {"torch"}
    results = run_pods(pods, tmp_path)
    assert_job(results, "KubeflowTorchEnvironment", one_process_weights)


@pytest.mark.backend("jax")
def test_the_jax_trainjob_pods_form_the_job_and_train(tmp_path, one_process_weights):
    pods = trainjob_pods("kubeflow-jax.yaml")
    assert {env["KERAS_BACKEND"] for _, env in pods} == {"jax"}
    results = run_pods(pods, tmp_path)
    assert_job(results, "JaxEnvironment", one_process_weights)


@pytest.mark.backend("jax")
def test_the_jobset_pods_form_the_job_and_train(tmp_path, one_process_weights):
    pods = jobset_pods("jobset.yaml")
    assert {env["KERAS_BACKEND"] for _, env in pods} == {"jax"}
    results = run_pods(pods, tmp_path)
    assert_job(results, "JobSetEnvironment", one_process_weights)
