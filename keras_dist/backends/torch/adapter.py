"""PyTorch adapter: one process per device, `torch.distributed` process groups.

`DataParallel` trains through torch's own `DistributedDataParallel` inside
Keras' `fit`. A torch `DataLoader` is split between processes the way
`DistributedSampler` splits a dataset, epoch set automatically: each process
loads only its own rows of each global batch (`ShardedLoader`).

`ModelParallel` layouts that shard variables run through DTensor
(`dtensor`): for the call, every weight and its optimizer slots become
DTensors on a torch mesh of the keras_dist mesh's shape (one device per
process), sharded where the `LayoutMap` says; every process reads the whole
global batch and computes on its rows along the batch axis (all of them when
that axis has size 1). No DDP is involved: DTensor brings the collectives, and
the outputs are gathered before loss and metrics, which are global as they are.
When the call ends the variables are gathered back into plain full tensors. A
layout that shards nothing (its axes have size 1) takes the replicated path.
Variables split along the batch axis only (pure FSDP) skip DTensor's per-op
dispatch inside the model: each layer computes on plain tensors, as FSDP2 does
(`dtensor.ShardedRun`, `fsdp_compute`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import weakref
from typing import Any

import keras
import numpy as np
import torch
import torch.distributed as torch_distributed
from torch._utils import _unflatten_dense_tensors
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.nn.parallel import DistributedDataParallel

from keras_dist.backends.base import BackendAdapter
from keras_dist.backends.torch import keras_internals as internals
from keras_dist.backends.torch import metric_sync, process_group
from keras_dist.backends.torch import remat as torch_remat
from keras_dist.backends.torch.global_moments import global_batch_norm, global_moments
from keras_dist.backends.torch.input_adapter import (
    ProcessLocalRankBatches,
    RankBatches,
    ShardedLoader,
    shard_loader,
)
from keras_dist.common.batch_norm import GlobalBatchNorm
from keras_dist.common.padding import check_same_input
from keras_dist.common.random_streams import BackendStream, take_process_zero_streams
from keras_dist.faults import heartbeat
from keras_dist.keras_compat import torch_trainer
from keras_dist.keras_compat.distribution import route_output_layouts
from keras_dist.keras_compat.steps import install_steps, remove_steps


def _dtensor() -> Any:
    """keras_dist's DTensor module, imported only when a layout names a mesh
    axis: `torch.distributed.tensor` adds about a second to every start."""
    from keras_dist.backends.torch import dtensor  # noqa: PLC0415

    return dtensor


def _gather_resting(model: Any) -> None:
    """Gather the optimizer state a run left split
    (`split_state.gather_resting`); nothing, and no import, when no run ever
    split one."""
    split_state = sys.modules.get("keras_dist.backends.torch.split_state")
    if split_state is not None:
        split_state.gather_resting(model)


def _placements() -> Any:
    """keras_dist's torch meshes and placements, imported as lazily (see
    `_dtensor`)."""
    from keras_dist.backends.torch import placements  # noqa: PLC0415

    return placements


def _use_local_gpu() -> None:
    """Each process of a host on its own GPU, as torchrun users expect: the
    GPU of its local rank (`LOCAL_RANK` from `keras-dist launch` and
    torchrun, else `SLURM_LOCALID`), modulo the GPUs it sees. Keras' torch
    backend puts tensors on the current CUDA device."""
    if not torch.cuda.is_available():
        return
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit():
            torch.cuda.set_device(int(raw) % torch.cuda.device_count())
            return


def _destroy_process_group() -> None:
    if torch_distributed.is_available() and torch_distributed.is_initialized():
        torch_distributed.destroy_process_group()


# How long after the hang timeout a collective still waits: the hang doctor
# needs a few seconds to collect the dumps and end the job.
_HANG_REPORT_SECONDS = 60.0
# How many of the latest collectives the hang doctor shows.
_TRACE_ENTRIES = 8


def _describe_flight_record(record: dict) -> str:
    """A few lines out of torch's Flight Recorder dump (its JSON form)."""
    entries = record.get("entries") or []
    if not entries:
        return (
            "torch's Flight Recorder recorded nothing (it records when "
            "TORCH_FR_BUFFER_SIZE > 0 before the process group starts)"
        )
    lines = [f"torch Flight Recorder, {len(entries)} collective(s) recorded"]
    configs = record.get("pg_config") or {}
    for group, status in (record.get("pg_status") or {}).items():
        ranks = next(iter(configs.values()), {}).get("ranks", "?")
        lines.append(
            f"  process group {group} (ranks {ranks}): last enqueued collective "
            f"#{status.get('last_enqueued_collective')}, last started "
            f"#{status.get('last_started_collective')}, last completed "
            f"#{status.get('last_completed_collective')}"
        )
    for entry in entries[-_TRACE_ENTRIES:]:
        lines.append(
            f"  #{entry.get('collective_seq_id')} {entry.get('profiling_name')} "
            f"sizes {entry.get('input_sizes')} state {entry.get('state')}"
        )
    return "\n".join(lines)


def _no_wait() -> None:
    """The wait of a sum already done."""


def _accelerator_type() -> str | None:
    return "gpu" if torch.cuda.is_available() else None


class TorchAdapter(BackendAdapter):
    name = "torch"

    def simulate_cpu_devices(self, count: int) -> None:
        if count != 1:
            raise NotImplementedError(
                f"KERAS_DIST_CPU_DEVICES={count}: PyTorch runs one device per "
                "process. Start several processes instead, e.g. "
                f"`keras-dist launch --nproc-per-node {count} script.py`."
            )

    def _world(self) -> tuple[int, int]:
        return process_group.world()

    def list_devices(self, device_type: str | None = None) -> list[str]:
        device_type = device_type or _accelerator_type() or "cpu"
        world_size, _ = self._world()
        if device_type == "gpu":
            per_process = torch.cuda.device_count() if world_size == 1 else 1
            return [f"gpu:{index}" for index in range(per_process * world_size)]
        if device_type == "cpu":
            return [f"cpu:{index}" for index in range(world_size)]
        return []

    def device_memory_bytes(self, device: str) -> int | None:
        platform, _, index = str(device).partition(":")
        if platform != "gpu" or not index.isdigit() or not torch.cuda.is_available():
            return None
        # Global device i of a job with one GPU per process is that process'
        # GPU; every GPU of a job is taken to be alike.
        local = int(index) % torch.cuda.device_count()
        return int(torch.cuda.get_device_properties(local).total_memory)

    def local_device_count(self, device_type: str | None = None) -> int:
        world_size, _ = self._world()
        return len(self.list_devices(device_type)) // world_size

    def num_processes(self) -> int:
        return self._world()[0]

    def process_id(self) -> int:
        return self._world()[1]

    def initialize(
        self,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_seconds: float,
    ) -> None:
        backend = process_group.backend_to_start()
        _use_local_gpu()
        try:
            torch_distributed.init_process_group(
                backend=backend,
                init_method=f"tcp://{coordinator_address}",
                world_size=num_processes,
                rank=process_id,
                timeout=datetime.timedelta(seconds=timeout_seconds),
            )
        except Exception as error:  # torch raises DistStoreError, RuntimeError...
            raise RuntimeError(
                f"Process {process_id} of {num_processes} could not join the job "
                f"coordinated at {coordinator_address} within {timeout_seconds:g} "
                f"s (torch.distributed backend {backend!r}; "
                f"{process_group.BACKEND_VARIABLE} chooses another): {error}"
            ) from error
        # Without this, gloo may abort the interpreter at exit ("terminate
        # called without an active exception").
        atexit.register(_destroy_process_group)
        # The hang doctor names the rank a hung collective waits for; the
        # collective's own timeout (naming no rank) must not end it first.
        outlast = heartbeat.hang_timeout() + _HANG_REPORT_SECONDS
        waits = max(outlast if heartbeat.hang_timeout() > 0 else 0, timeout_seconds)
        if waits > timeout_seconds:
            # Public from torch 2.14 (the private one warns there).
            set_timeout = getattr(torch_distributed, "set_timeout", None) or (
                torch_distributed.distributed_c10d._set_pg_timeout
            )
            set_timeout(datetime.timedelta(seconds=waits))
        # keras_dist's collectives on CPU tensors need gloo: NCCL's job gets a
        # gloo group of the same processes, made here while every process is,
        # waiting as long as the default group.
        process_group.cpu_group(datetime.timedelta(seconds=waits))

    def barrier(self, name: str, *, timeout_seconds: float) -> None:
        try:
            process_group.bounded_barrier(timeout_seconds)
        except Exception as error:  # torch raises DistBackendError, RuntimeError
            raise self._barrier_timed_out(name, timeout_seconds, error) from error

    def wait_for_process_zero(self, key: str, *, timeout_seconds: float) -> None:
        world_size, rank = self._world()
        if world_size == 1:
            return
        # The key-value store the process group was formed through.
        store = torch_distributed.distributed_c10d._get_default_store()
        key = f"keras_dist:{key}"
        try:
            if rank == 0:
                store.set(key, "done")
            else:
                store.wait([key], datetime.timedelta(seconds=timeout_seconds))
        except Exception as error:  # torch raises DistStoreError, RuntimeError
            raise self._barrier_timed_out(key, timeout_seconds, error) from error

    def gather_numbers(
        self, values: list[float], *, timeout_seconds: float
    ) -> list[list[float]]:
        world_size, rank = self._world()
        if world_size == 1:
            return [[float(value) for value in values]]
        # Through the process group's key-value store: no device tensors (NCCL
        # would need CUDA ones), nothing queued behind DDP's collectives.
        store = torch_distributed.distributed_c10d._get_default_store()
        self._gathers = getattr(self, "_gathers", 0) + 1
        keys = [f"keras_dist:gather:{self._gathers}:{r}" for r in range(world_size)]
        try:
            store.set(keys[rank], json.dumps([float(value) for value in values]))
            store.wait(keys, datetime.timedelta(seconds=timeout_seconds))
            return [json.loads(store.get(key)) for key in keys]
        except Exception as error:  # torch raises DistStoreError, RuntimeError
            raise self._barrier_timed_out(
                f"gather #{self._gathers}", timeout_seconds, error
            ) from error

    def device_kind(self) -> str | None:
        device = self._device()
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        return device.type

    def collective_trace(self) -> str | None:
        """What torch's Flight Recorder (gloo and NCCL) kept: each process
        group's last enqueued, started and completed collective, and the
        latest collectives. It records when `TORCH_FR_BUFFER_SIZE` was set
        before the process group started (`keras_dist.initialize` does)."""
        if not torch_distributed.is_initialized():
            return None
        return _describe_flight_record(
            json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
        )

    def to_backend_mesh(self, device_mesh: Any) -> Any:
        """A `torch.distributed.device_mesh.DeviceMesh` (one device per process)."""
        return _placements().torch_mesh(device_mesh)

    def to_backend_layout(self, tensor_layout: Any) -> Any:
        """The layout's DTensor placements, one per mesh axis."""
        if tensor_layout.device_mesh is None:
            raise ValueError(
                "A TensorLayout needs a device mesh for its backend layout; build "
                f"it with `device_mesh=`. Received: {tensor_layout}"
            )
        return _placements().placements(
            tensor_layout.axes, tensor_layout.device_mesh.axis_names
        )

    def unsupported_split(self, layer: Any, variable: Any, axes: tuple) -> str | None:
        """What DTensor (torch 2.13) has no sharding rules for, measured on
        CPU: a Conv1D/2D/3D with split variables, and an Embedding whose table
        is split along its rows (the vocabulary)."""
        import keras

        if all(axis is None for axis in axes):
            return None
        convolutions = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
        if isinstance(layer, convolutions):
            return (
                "PyTorch's DTensor cannot run a convolution whose variables are split"
            )
        if (
            isinstance(layer, keras.layers.Embedding)
            and variable.name == "embeddings"
            and axes[0] is not None
        ):
            return (
                "PyTorch's DTensor cannot look up the rows of an embedding table "
                "split along its rows (the vocabulary)"
            )
        return None

    def is_backend_layout(self, layout: Any) -> bool:
        """DTensor placements, one per mesh axis (for a DTensor, on its mesh)."""
        if not isinstance(layout, (tuple, list)) or not layout:
            return False
        modules = [type(item).__module__ for item in layout]
        if not all(module.startswith("torch.distributed") for module in modules):
            return False  # not placements: no need to import DTensor
        return _placements().is_placements(layout)

    def distribute_tensor(self, tensor: Any, tensor_layout: Any) -> Any:
        """A DTensor laid out as `tensor_layout` says (torch's own semantics: a
        plain tensor is process 0's value, a DTensor is redistributed)."""
        if self.is_backend_layout(tensor_layout):
            return _placements().redistribute(tensor, tensor_layout)
        return _placements().distribute(
            tensor,
            tensor_layout.device_mesh.backend_mesh,
            tensor_layout.backend_layout,
            self._device(),
        )

    # -- training --------------------------------------------------------------
    def _device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_layouts(self, model: Any, distribution: Any) -> bool:
        """Whether the layouts shard variables (the DTensor path); raises for
        what cannot run."""
        world_size, _ = self._world()
        layouts = [distribution.layout_for_variable(v) for v in model.variables]
        if any(axis is not None for layout in layouts for axis in layout.axes):
            placements = _placements()
            if any(placements.is_sharded(layout) for layout in layouts):
                # One device per process: the mesh must have one per process.
                placements.mesh_ranks(distribution.device_mesh, world_size)
                placements.check_batch_axis(distribution)
                return True
        if distribution.num_model_replicas != world_size:
            raise ValueError(
                "On PyTorch each process drives one device, so a DataParallel over "
                f"{distribution.num_model_replicas} devices needs that many "
                f"processes (e.g. `keras-dist launch --nproc-per-node "
                f"{distribution.num_model_replicas}`). Received: {world_size} "
                "process(es)"
            )
        return False

    def _collectives(self, model: Any, user_steps: set[str]) -> internals.Collectives:
        world_size, _ = self._world()
        forward = model
        sync = process_group.gradient_sync(self._device())
        own_step = world_size > 1 and "train_step" not in user_steps
        after_backward = own_step and sync == "after_backward"
        if own_step and not after_backward:
            # Gradients are averaged by DDP's bucketed all-reduce during backward,
            # DDP's own (C++) reducer: a Python communication hook would run
            # each bucket's all-reduce through the interpreter lock, which
            # gloo's threads then wait for. With `after_backward` (on CPU) the
            # step averages them itself, `average_after_backward`. (The user's
            # own train_step calls the model itself: its optimizers average
            # the gradients instead, see `average_gradients`.)
            forward = DistributedDataParallel(
                model, process_group=process_group.group_for(self._device())
            )

        # The group for each device's tensors (gloo for CPU tensors, also in
        # an NCCL job), looked up here, outside any compiled step.
        cpu_group = process_group.cpu_group()

        def group_of(tensor: Any) -> Any:
            return cpu_group if tensor.device.type == "cpu" else None

        def averaged(tensors: list[Any]) -> list[Any]:
            """Each of `tensors` averaged over the processes, in one all-reduce
            (views of a new buffer; the tensors themselves are left alone)."""
            flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
            flat /= world_size
            torch_distributed.all_reduce(
                flat, op=torch_distributed.ReduceOp.SUM, group=group_of(flat)
            )
            return _unflatten_dense_tensors(flat, tensors)

        def average_gradients(gradients: list[Any]) -> list[Any]:
            present = [g for g in gradients if g is not None]
            if world_size == 1 or not present:
                return gradients
            means = iter(averaged(present))
            return [None if g is None else next(means) for g in gradients]

        def start_sum(tensor: Any) -> Any:
            if world_size == 1:
                return _no_wait
            if torch.compiler.is_compiling():
                # Traced into the compiled step (TorchDynamo makes it a
                # functional all-reduce): summed now, in place.
                torch_distributed.all_reduce(
                    tensor, op=torch_distributed.ReduceOp.SUM, group=group_of(tensor)
                )
                return _no_wait
            work = torch_distributed.all_reduce(
                tensor,
                op=torch_distributed.ReduceOp.SUM,
                group=group_of(tensor),
                async_op=True,
            )
            return work.wait

        def average_after_backward(variables: list[Any]) -> None:
            # Every process all-reduces the same sizes: a weight without a
            # gradient here (a branch this process' rows did not take) sends
            # zeros, and one flag a weight says which processes had one.
            by_dtype: dict[Any, list[Any]] = {}
            for variable in variables:
                by_dtype.setdefault(variable.value.dtype, []).append(variable.value)
            for weights in by_dtype.values():
                missing = [w.grad is None for w in weights]
                parts = [
                    torch.zeros_like(w) if none else w.grad
                    for w, none in zip(weights, missing, strict=True)
                ]
                parts.append(torch.tensor([not none for none in missing]).to(parts[0]))
                *means, had = averaged(parts)
                torch._foreach_copy_(parts[:-1], means)
                if any(missing):
                    # A gradient some process had; none where no process had one.
                    for weight, part, anywhere in zip(
                        weights, parts, had.tolist(), strict=False
                    ):
                        weight.grad = part if anywhere else None

        def gather_from_processes(tensor: Any) -> Any:
            if world_size == 1:
                return tensor
            parts = [torch.empty_like(tensor) for _ in range(world_size)]
            torch_distributed.all_gather(
                parts, tensor.contiguous(), group=group_of(tensor)
            )
            return torch.cat(parts)

        if after_backward:  # a micro-step of gradient accumulation: no average
            skip_gradient_sync = contextlib.nullcontext
        elif forward is not model:  # its gradients un-reduced in DDP's no_sync
            skip_gradient_sync = forward.no_sync
        else:
            skip_gradient_sync = None
        return internals.Collectives(
            world_size=world_size,
            start_sum=start_sum,
            gather_from_processes=gather_from_processes,
            average_gradients=average_gradients,
            forward=forward,
            no_grad=torch.no_grad,
            skip_gradient_sync=skip_gradient_sync,
            average_after_backward=average_after_backward if after_backward else None,
        )

    def _broadcast_from_process_zero(self, model: Any) -> None:
        """Replicas start equal: process 0's values win, as DDP does."""
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        for variable in variables:
            value = variable.value.detach().clone()
            torch_distributed.broadcast(
                value, src=0, group=process_group.group_for(value.device)
            )
            variable.assign(value)

    def take_process_zero_streams(self) -> None:
        """Every process takes process 0's NumPy, Python and torch random
        generators, from which Keras shuffles (a collective)."""

        def broadcast(state: np.ndarray) -> np.ndarray:
            words = torch.as_tensor(state.astype("int64"))
            torch_distributed.broadcast(words, src=0, group=process_group.cpu_group())
            return words.numpy()

        take_process_zero_streams(broadcast, self.random_stream())

    def random_stream(self) -> BackendStream:
        """torch's global generator (the array adapter's DataLoader shuffles
        with it)."""
        return BackendStream(
            get=lambda: torch.get_rng_state().numpy(),
            set=lambda words: torch.set_rng_state(
                torch.as_tensor(np.asarray(words, "uint8"))
            ),
        )

    def _check_same_input(self, fingerprint: int) -> None:
        world_size, _ = self._world()
        local = torch.tensor([fingerprint], dtype=torch.int64)
        everyone = [torch.empty_like(local) for _ in range(world_size)]
        torch_distributed.all_gather(everyone, local, group=process_group.cpu_group())
        check_same_input([int(t.item()) for t in everyone])

    def activate(self, model: Any, distribution: Any) -> None:
        try:
            self._activate(model, distribution)
        except BaseException:
            # Nothing half-done stays behind: sharded variables are gathered
            # back, patches and hooks removed.
            self._undo_activation(model)
            raise

    def call_starting(self, model: Any, name: str, distribution: Any) -> Any:
        """Keras builds the optimizer before the call's run starts: with
        sharded variables its slots are split as they are made
        (`split_state.split_when_made`), never held whole. A `fit` without
        sharded variables first gathers the optimizer state a run left split
        (`FSDP(keep_optimizer_sharded=True)`); `evaluate` and `predict` do
        not read it."""
        sharded = isinstance(distribution, keras.distribution.ModelParallel)
        if name == "fit" and not sharded:
            _gather_resting(model)
        if (
            not sharded
            or not torch_distributed.is_initialized()
            or torch_distributed.get_world_size() == 1
        ):
            return contextlib.nullcontext()
        from keras_dist.backends.torch import split_state  # noqa: PLC0415 (see _dtensor)

        return split_state.split_when_made(model, distribution)

    def _activate(self, model: Any, distribution: Any) -> None:
        dtensors = self._check_layouts(model, distribution)
        world_size, rank = self._world()
        # The user's own steps run as written (see `custom_steps`).
        user_steps = internals.user_steps(model)
        # Under DDP each process keeps its own metric states (`metric_sync`
        # marks those built later); under DTensor they are global.
        metric_sync.mark_metric_states(
            list(model.metrics_variables), per_process=world_size > 1 and not dtensors
        )
        # Keras 3.16's torch trainer distributes by itself once torch.distributed
        # is initialized; in keras_dist's run keras_dist does it, once: its
        # own metric sums, and torch ops outside Keras' DTensor dispatch mode
        # (keras_dist mixes DTensors and plain tensors itself).
        self._on_deactivate(model, torch_trainer.metrics_summed_by_keras_dist(model))
        self._on_deactivate(model, torch_trainer.leave_dtensor_promotion())
        if dtensors:
            # Variables become DTensors (process 0's values); every process
            # computes on each whole global batch: one replica, data not split.
            run = _dtensor().ShardedRun(model, distribution).start()
            # At the end: back to plain, full tensors, an ordinary Keras model.
            self._on_deactivate(model, run.stop)
            # A recomputed layer gathers its split variables again.
            recomputable = run.recomputable
            collectives = _dtensor().collectives(run)
            replicas, replica = 1, 0
        else:
            # What an FSDP run left split is whole again for this one.
            _gather_resting(model)
            if world_size > 1:
                self._broadcast_from_process_zero(model)
            collectives = self._collectives(model, user_steps)
            replicas, replica = world_size, rank
            recomputable = None
        # The calls `remat` recomputes: keeping what its policy names.
        self._on_deactivate(
            model, torch_remat.recompute(model, distribution, recomputable)
        )
        # One DistributedDataParallel: keras_dist's (or none), lent to Keras so
        # that it wraps nothing itself.
        ddp = collectives.forward if collectives.forward is not model else None
        self._on_deactivate(model, torch_trainer.lend_ddp(model, ddp))
        device = self._device()

        def gather_sizes(local: np.ndarray) -> np.ndarray:
            tensor = torch.as_tensor(local)
            parts = [torch.empty_like(tensor) for _ in range(world_size)]
            torch_distributed.all_gather(parts, tensor, group=process_group.cpu_group())
            return torch.stack(parts).numpy()

        # Per Keras data adapter wrapping a torch DataLoader: the loader split
        # between processes, or None when it cannot be (see `shard_loader`).
        sharded: weakref.WeakKeyDictionary[Any, ShardedLoader | None] = (
            weakref.WeakKeyDictionary()
        )

        def batches_for_epoch(data_adapter: Any) -> Any:
            if world_size > 1 and not distribution.auto_shard_dataset:
                # Each process reads its own part of the data.
                return ProcessLocalRankBatches(
                    data_adapter.get_numpy_iterator(),
                    device=device,
                    gather_sizes=gather_sizes,
                )
            loader = internals.data_loader_of(data_adapter)
            # Sharded variables: every process reads the whole batches (and the
            # first one is checked to be the same everywhere).
            if loader is not None and not dtensors:
                if data_adapter not in sharded:
                    # Keras asks for each epoch's iterator at the same point on
                    # every process, so this collective is reached by all.
                    sharded[data_adapter] = shard_loader(
                        loader,
                        world_size=world_size,
                        rank=rank,
                        device=device,
                        gather=gather_sizes if world_size > 1 else None,
                    )
                if sharded[data_adapter] is not None:
                    # Each process loads only its rows of each global batch.
                    return sharded[data_adapter].epoch()
            # Keras' own batches as plain Keras reads them on torch (its
            # DataLoader shuffles arrays from torch's generator).
            return RankBatches(
                internals.keras_batches(data_adapter),
                world_size=replicas,
                rank=replica,
                device=device,
                share_random_streams=(
                    self.take_process_zero_streams if world_size > 1 else None
                ),
                check_same_input=self._check_same_input if world_size > 1 else None,
            )

        # Reading a batch is the hang doctor's phase "data".
        internals.route_batches(heartbeat.watching_batches(batches_for_epoch))
        self._on_deactivate(model, internals.unroute_batches)
        # A step that raised in its forward leaves no batch rows behind.
        self._on_deactivate(model, GlobalBatchNorm.clear)
        steps = internals.make_steps(model, collectives, user_steps)
        if dtensors:
            steps = run.wrap_steps(steps)
            relayout = run.relayout
        else:
            # Replicated variables: each process' tensors are its own rows.
            def relayout(tensor: Any, layout: Any) -> Any:
                return tensor

        self._on_deactivate(model, route_output_layouts(relayout))
        install_steps(model, steps)
        self._on_deactivate(model, lambda: remove_steps(model))
        self._count_real_rows(model)
        self._average_gradients(model)
        if not dtensors:
            # BatchNormalization leaves padding rows out and, by default,
            # normalizes over the whole global batch (SyncBatchNorm). (Sharded
            # variables: DTensor's own statistics are global, nothing is padded.)
            together = GlobalBatchNorm.Replicas(
                sum=lambda tensor: differentiable_all_reduce(
                    tensor, group=process_group.group_for(tensor.device)
                ),
                index=lambda: rank,
                count=world_size,
                fused=global_moments,
                normalize=global_batch_norm,
            )
            sync = replicas > 1 and getattr(distribution, "sync_batch_norm", True)
            self._normalize_batches(
                model, together if sync else GlobalBatchNorm.Replicas()
            )

    def deactivate(self, model: Any) -> None:
        self._undo_activation(model)


ADAPTER = TorchAdapter()
