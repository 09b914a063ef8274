"""`ModelParallel` on PyTorch: sharded variables as `torch.distributed.tensor`.

Each process drives one device of the mesh. While a `fit`, `evaluate` or
`predict` runs under a `ModelParallel` whose `LayoutMap` shards variables, every
weight of the model is a DTensor on a torch `DeviceMesh` with the keras_dist
mesh's shape and axis names: a tensor dimension laid out along a mesh axis is
`Shard(dim)` on that axis, anything else `Replicate()`, so each process holds
1/N of a variable sharded N ways. The optimizer's slots (Adam's moments, SGD's
momentum...) get the placements of the variable they mirror; its scalars (the
iteration count, the learning rate) stay plain tensors. The values come from
process 0, as `DistributedDataParallel` does for replicas.

Every process reads the whole global batch. With a batch axis of size N > 1
the model's inputs become DTensors split into N row blocks along that axis
(each process keeps its block, no communication; uneven blocks are fine, so
there is no padding), so the compute is split as in data parallelism; with a
batch axis of size 1 they act as replicated (`implicit_replication`, which also
lets plain tensors inside layers mix with DTensors). torch's DTensor dispatch
inserts the collectives that the sharded ops need, including the reduction of
the gradients of variables replicated along the batch axis. The model's outputs
are gathered into plain full tensors before the loss and the metrics, so losses,
metrics and predictions are computed alike, and are global, on every process.

When the call ends the variables are gathered back into plain, full tensors: the
model is then an ordinary Keras model again (`model(x)`, `get_weights()`,
`save_weights()`, a later call without a distribution all work as usual), and
the next distributed call shards it again. While a call runs, `np.asarray` of a
sharded variable (`get_weights()`, checkpoints in callbacks) gathers its full
value, which is collective: every process must do it, as keras_dist's
callbacks do. With `FSDP(keep_optimizer_sharded=True)` the optimizer's slots
stay split between calls (`split_state`): reading one gathers it (collective),
the next run under the same layouts takes them as they are, and a `fit`
without sharded variables gathers them first.

Memory as FSDP2's: the optimizer slots that Keras builds during a call are
split as each is made (`split_state.split_when_made`), never all whole; a
value a variable no longer holds is freed at once (`split_state.free`), not when the
layers let go of it (the whole model next to its parts); the last step's
gradients are dropped before the end of a call gathers; and in plain compute
the optimizer updates its parts in a few groups (`update_in_pieces`), so
Keras' temporaries are a fraction of a process' share, not three times it.

An op that DTensor cannot run (e.g. a sharded `Conv2D` kernel in this torch
release) fails with a `NotImplementedError` that names the op and the layer.

Pure FSDP (variables split along the batch axis only) skips DTensor's per-op
dispatch inside the model, as FSDP2 does: each layer computes on this
process' rows and its whole weights as plain tensors, gathered in one
collective per layer call, and the model's outputs are gathered into the
whole batch's (`fsdp_plain`, on `fsdp_compute`'s collectives). The
variables, the optimizer's slots and what callbacks see are the same
DTensors either way.
"""

from __future__ import annotations

import contextlib
import linecache
import re
from collections.abc import Callable, Iterator
from typing import Any

import keras
import torch
import torch.distributed as torch_distributed
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication

from keras_dist.backends.torch import keras_internals as internals
from keras_dist.backends.torch import process_group
from keras_dist.backends.torch.fsdp_compute import to_full
from keras_dist.backends.torch.fsdp_plain import (
    PlainCompute,
    plain_compute_group,
)
from keras_dist.backends.torch.placements import (
    device_type,
    placements,
    torch_mesh,
)
from keras_dist.backends.torch.split_state import (
    distribute,
    gather,
    patch_variables,
    rest,
    split_slot,
    take_resting,
    unpatch_variables,
)
from keras_dist.keras_compat.layers import layers_of
from keras_dist.keras_compat.optimizers import each_new_slot, slot_owners

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# -- failures ------------------------------------------------------------------
def _frames(error: BaseException) -> list[Any]:
    frames = []
    traceback = error.__traceback__
    while traceback is not None:
        frames.append(traceback)
        traceback = traceback.tb_next
    return frames


def _failed_op(error: BaseException) -> str | None:
    """The op that raised `error`, innermost first: the aten op DTensor was
    dispatching, else the torch call in Keras' torch backend, else one that the
    message names."""
    frames = _frames(error)
    for traceback in reversed(frames):
        op = traceback.tb_frame.f_locals.get("op_call")
        if isinstance(op, torch._ops.OpOverload):
            return str(op)
    for traceback in reversed(frames):
        code = traceback.tb_frame.f_code
        filename = code.co_filename.replace("\\", "/")
        if "keras/src/backend/torch/" in filename:
            module = traceback.tb_frame.f_globals.get("__name__", "")
            line = linecache.getline(code.co_filename, traceback.tb_lineno).strip()
            return f"`{line}` ({module}.{code.co_name})"
    match = re.search(r"\baten\.[\w.]+", str(error))
    return match.group(0).rstrip(".") if match else None


def _from_dtensor(error: BaseException) -> bool:
    for traceback in _frames(error):
        filename = traceback.tb_frame.f_code.co_filename.replace("\\", "/")
        if "torch/distributed/tensor/" in filename:
            return True
    return "DTensor" in str(error) or "sharding strateg" in str(error)


def _attention_kernels() -> contextlib.AbstractContextManager:
    """On CPU, `scaled_dot_product_attention` through its math kernel: DTensor
    (torch 2.13) has no sharding rule for the backward of the CPU
    flash-attention kernel torch picks otherwise (Keras' MultiHeadAttention,
    KerasHub's attention), and the math kernel is made of ops it shards. The
    result is the same attention, up to float rounding."""
    if device_type() != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


class ShardedRun:
    """One model's variables sharded as DTensors, from `start()` to `stop()`.

    Two ways of computing, chosen in `start()`:

    - DTensor compute (any layout): the model's inputs are DTensors split
      along the batch axis and every op goes through DTensor's dispatch,
      which inserts the collectives the layouts need. Each layer's
      batch-split trainable variables are gathered while it runs.
    - Plain compute (pure FSDP: no variable is split along another mesh axis
      of size > 1; no BatchNormalization; see `fsdp_plain`): what
      FSDP2 does. Each process computes on its rows of every batch as plain
      tensors, each layer call gathers the whole values of its own variables
      (all-gathers issued together, `fsdp_compute`), whose backward reduce-scatters the
      gradients onto their owners; the whole values are freed when the
      layer's forward ends and gathered again in its backward (inside the
      steps: `_step`); the model's outputs are gathered into the whole
      batch's. A variable read inside the model outside its own layer
      (a tied weight), or while the loss is computed (a weight regularizer),
      is gathered the same way. No DTensor op runs inside the model, so an
      op there that mixes rows sees this process' rows only, as under
      DataParallel (losses that layers add are averaged over processes,
      `PlainCompute`). Between steps and in the optimizer update the
      variables are DTensors as in DTensor compute; an optimizer that updates
      every element on its own (Adam, SGD...:
      `PlainCompute.updates_elementwise`) updates each process' parts as
      plain tensors.

    Args:
        model: the Keras model.
        distribution: the `ModelParallel` whose layouts shard it.
    """

    def __init__(self, model: Any, distribution: Any):
        self.model = model
        self.distribution = distribution
        self.mesh = torch_mesh(distribution.device_mesh)
        self._variables: list[Any] = []  # every variable made a DTensor
        # id(variable) -> its DTensor Parameter (what it holds between layers).
        self._values: dict[int, Any] = {}
        self._hooks: list[Any] = []
        self._layers: list[Any] = []  # the layers being called, innermost last
        self._depth = 0
        # Variables split along the batch axis, gathered while their layer runs:
        # id -> (variable, its sharded Parameter, how many calls hold it).
        self._gathered: dict[int, list[Any]] = {}
        self._all_layers: list[Any] = []  # the model and every layer in it
        # Plain compute (see the class; `fsdp_plain`), None for DTensor compute.
        self._plain: PlainCompute | None = None

    # -- variables -------------------------------------------------------------
    def _planned(self) -> list[tuple[Any, Any]]:
        """Every variable that becomes a DTensor, with its layout's axes."""
        model, distribution = self.model, self.distribution
        planned: dict[int, tuple[Any, Any]] = {}
        for variable in model.weights:
            layout = distribution.layout_for_variable(variable)
            planned.setdefault(id(variable), (variable, layout.axes))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and model.trainable_weights and not optimizer.built:
            # Each slot is split as soon as it is made (`split_when_made`).
            def split(reference: Any, slot: Any) -> None:
                split_slot(distribution, reference, slot)

            with each_new_slot(optimizer, split):
                optimizer.build(model.trainable_weights)
        if optimizer is not None and optimizer.built:
            owners = slot_owners(optimizer, model.trainable_weights)
            for slot in optimizer.variables:
                owner = owners.get(id(slot))
                if owner is not None and id(owner) in planned:
                    planned.setdefault(id(slot), (slot, planned[id(owner)][1]))
        return list(planned.values())

    def _distribute(self, variable: Any, where: Any) -> Any:
        return distribute(variable, self.mesh, where)

    def _plain_optimizer_variables(self) -> list[Any]:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return []
        sharded = {id(variable) for variable in self._variables}
        return [v for v in optimizer.variables if id(v) not in sharded]

    def start(self) -> ShardedRun:
        axis_names = list(self.distribution.device_mesh.axis_names)
        # Slots split when made, or left split by the last run: taken as they
        # are when laid out as this run lays them out, else gathered first.
        take_resting(self.model)
        with torch.no_grad():
            for variable, axes in self._planned():
                where = placements(axes, axis_names)
                parameter = internals.variable_storage(variable)
                if isinstance(parameter, DTensor) and (
                    parameter.device_mesh != self.mesh
                    or tuple(parameter.placements) != tuple(where)
                ):
                    gather(variable)
                    parameter = internals.variable_storage(variable)
                if not isinstance(parameter, DTensor):
                    parameter = self._distribute(variable, where)
                self._variables.append(variable)
                self._values[id(variable)] = parameter
            # The optimizer's scalars (iterations...) start as process 0's too.
            for variable in self._plain_optimizer_variables():
                value = variable.value.detach().clone()
                torch_distributed.broadcast(
                    value, src=0, group=process_group.group_for(value.device)
                )
                variable.assign(value)
        internals.retrack_parameters(self.model)
        self._all_layers = layers_of(self.model)
        batch_axis = self._batch_axis_index()
        group = plain_compute_group(
            self.mesh,
            batch_axis,
            self.distribution.batch_dim_name,
            self._values,
            self._all_layers,
        )
        policy = getattr(self.distribution, "mixed_precision", None)
        reduce_dtype = policy.reduce_dtype if policy is not None else None
        if reduce_dtype is not None and group is None:
            self.stop()
            raise NotImplementedError(
                f"mixed_precision={policy!r}: on PyTorch gradients are summed in a "
                "dtype of their own only by FSDP along the batch axis (plain "
                "compute). This run computes through DTensor (a variable split "
                "along a model axis, a BatchNormalization layer, or a split "
                "non-trainable variable), whose ops sum a gradient in the dtype "
                "they compute it in. Leave `reduce_dtype` None there."
            )
        if group is not None:
            self._plain = PlainCompute(
                model=self.model,
                mesh=self.mesh,
                batch=group,
                batch_axis=batch_axis,
                values=self._values,
                variables=self._variables,
                layers=self._all_layers,
                calling=self._layers,
                reduce_dtype=reduce_dtype,
            )
        self._track_layers()
        patch_variables()
        return self

    def stop(self) -> None:
        """Gather every variable back into a plain, full tensor (collective);
        with `FSDP(keep_optimizer_sharded=True)` the optimizer's slots stay
        split (`split_state.rest`)."""
        optimizer = getattr(self.model, "optimizer", None)
        resting: list[Any] = []
        if getattr(self.distribution, "keep_optimizer_sharded", False) and (
            optimizer is not None and optimizer.built
        ):
            slots = {id(variable) for variable in optimizer.variables}
            resting = [v for v in self._variables if id(v) in slots]
        if resting:
            rest(self.model, resting)
        unpatch_variables()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with torch.no_grad():
            # The last step's gradients go first: the whole values are then
            # gathered next to the parts only.
            for value in self._values.values():
                value.grad = None
            if self._plain is not None:
                self._plain.release_locals()
            kept = {id(variable) for variable in resting}
            for variable in self._variables:
                if id(variable) not in kept:
                    gather(variable)
        self._variables.clear()
        self._values.clear()
        self._plain = None
        internals.retrack_parameters(self.model)

    def relayout(self, tensor: Any, layout: Any) -> Any:
        """A layer output laid out as the `LayoutMap` says (`"<layer>/output"`
        entries): a DTensor is redistributed, autograd included; a plain tensor
        (full on every process) is left as it is."""
        if not isinstance(tensor, DTensor):
            return tensor
        names = list(self.distribution.device_mesh.axis_names)
        return tensor.redistribute(self.mesh, placements(layout.axes, names))

    # -- layers, outputs and failures ------------------------------------------
    def _track_layers(self) -> None:
        batch_placements = None
        if self.distribution.num_model_replicas > 1:
            # The batch rows are split along the batch axis: each process
            # computes on its share of every global batch.
            batch_placements = tuple(
                Shard(0) if name == self.distribution.batch_dim_name else Replicate()
                for name in self.distribution.device_mesh.axis_names
            )

        def split_rows(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                return value
            if value.ndim == 0:
                return value
            # Every process holds the whole batch: each keeps its rows, no
            # communication (`src_data_rank=None`); uneven splits are fine.
            return distribute_tensor(
                value, self.mesh, batch_placements, src_data_rank=None
            )

        def enter(layer: Any, args: Any) -> Any:
            self._layers.append(layer)
            self._gather_own_variables(layer)
            if layer is self.model and batch_placements is not None:
                return keras.tree.map_structure(split_rows, args)
            return None

        def leave(layer: Any, args: Any, outputs: Any) -> Any:
            if self._layers and self._layers[-1] is layer:
                self._layers.pop()
            self._release_own_variables(layer)
            if layer is self.model:
                # Losses, metrics and predictions see plain, full tensors.
                return keras.tree.map_structure(to_full, outputs)
            return None

        if self._plain is not None:
            enter, leave = self._plain.enter, self._plain.leave
        for layer in self._all_layers:
            self._hooks.append(layer.register_forward_pre_hook(enter))
            self._hooks.append(layer.register_forward_hook(leave))

    # -- activation checkpointing ---------------------------------------------
    def recomputable(self, layer: Any, call: Callable) -> Callable:
        """`layer`'s `call` as activation checkpointing runs it (Keras'
        `rematerialized_call`: `torch.utils.checkpoint`). The first time the
        layer's forward pre-hook has gathered its own split variables; when
        the backward pass runs the call again (after the forward hook freed
        them) they are gathered again for the recomputation, as FSDP2 with
        activation checkpointing gathers a module's parameters again. That
        gather's autograd graph is the recomputation's, which torch throws
        away: the gradients flow through the first forward's gather. Layers
        inside the recomputed call gather through their own hooks; whatever a
        recomputation gathered is released when it ends (torch stops a
        recomputation early, past its layers' forward hooks)."""

        def call_with_own_variables(*args: Any, **kwargs: Any) -> Any:
            if self._layers and self._layers[-1] is layer:
                # The first forward: inside the layer's hooks.
                return call(*args, **kwargs)
            gathered = set(self._gathered)
            depth = len(self._layers)
            plain = self._plain
            held = plain.gathered_layers() if plain is not None else set()
            self._layers.append(layer)
            if plain is not None:
                plain.gather_for_recomputation(layer)
            else:
                self._gather_own_variables(layer)
            try:
                return call(*args, **kwargs)
            finally:
                del self._layers[depth:]
                if plain is not None:
                    plain.release_since(held)
                for key in [key for key in self._gathered if key not in gathered]:
                    variable, sharded, _ = self._gathered.pop(key)
                    internals.set_variable_storage(variable, sharded)

        return call_with_own_variables

    # -- what keras_dist's steps enter -----------------------------------------
    @contextlib.contextmanager
    def loss_scope(self) -> Iterator[None]:
        """Around the loss computation of keras_dist's steps: in plain compute,
        a variable read (a weight regularizer) gets its whole value, as inside
        the model (`PlainCompute.reading`)."""
        if self._plain is None:
            yield
            return
        with self._plain.reading():
            yield

    @contextlib.contextmanager
    def optimizer_update(self) -> Iterator[None]:
        """The optimizer's update (under `no_grad`); with an elementwise
        optimizer in plain compute, on each process' parts as plain tensors
        (`PlainCompute.local_update`)."""
        with torch.no_grad():
            if self._plain is None or not self._plain.updates_locally:
                yield
                return
            with self._plain.local_update():
                yield

    # -- FSDP: whole weights while their layer runs -----------------------------
    def _batch_axis_index(self) -> int | None:
        if self.distribution.num_model_replicas <= 1:
            return None
        names = list(self.distribution.device_mesh.axis_names)
        return names.index(self.distribution.batch_dim_name)

    def _gather_own_variables(self, layer: Any) -> None:
        """Gather the layer's trainable variables that are split along the batch
        axis (FSDP) before its call, so its ops see whole weights (still split
        along any model axis) and batch rows split along the same axis: no
        collective inside the op. The gather is part of autograd: its backward
        reduce-scatters each gradient onto this process' part, as FSDP does.
        Without this, DTensor picks per-op strategies for rows and weights split
        along one axis, which cost more communication."""
        index = self._batch_axis_index()
        if index is None:
            return
        for variable in internals.own_trainable_variables(layer):
            held = self._gathered.get(id(variable))
            if held is not None:
                held[2] += 1
                continue
            value = internals.variable_storage(variable)
            if not isinstance(value, DTensor) or not isinstance(
                value.placements[index], Shard
            ):
                continue
            whole = list(value.placements)
            whole[index] = Replicate()
            gathered = value.redistribute(self.mesh, tuple(whole))
            self._gathered[id(variable)] = [variable, value, 1]
            internals.set_variable_storage(variable, gathered)

    def _release_own_variables(self, layer: Any) -> None:
        for variable in internals.own_trainable_variables(layer):
            held = self._gathered.get(id(variable))
            if held is None:
                continue
            held[2] -= 1
            if held[2] == 0:
                internals.set_variable_storage(variable, held[1])
                del self._gathered[id(variable)]

    def _release_all_variables(self) -> None:
        """After a step, every variable holds its own part again (a layer that
        raised never reached its forward hook)."""
        for variable, sharded, _ in self._gathered.values():
            internals.set_variable_storage(variable, sharded)
        self._gathered.clear()
        if self._plain is not None:
            self._plain.release_all()

    def _sharded_layouts(self) -> dict[str, tuple]:
        return {
            variable.path: tuple(self._values[id(variable)].placements)
            for variable in self._variables
            if any(not p.is_replicate() for p in self._values[id(variable)].placements)
        }

    def _in_sharded_layer(self) -> bool:
        """Whether the innermost layer being called holds a sharded variable
        (not an outer one: the model holds them all)."""
        if not self._layers:
            return False
        sharded = {
            id(v)
            for v in self._variables
            if any(not p.is_replicate() for p in self._values[id(v)].placements)
        }
        return any(id(variable) in sharded for variable in self._layers[-1].weights)

    def _failure(self, error: BaseException) -> NotImplementedError:
        op = _failed_op(error) or "an op"
        if self._layers:
            layer = self._layers[-1]
            where = (
                f"layer {getattr(layer, 'path', None) or layer.name!r} "
                f"({type(layer).__name__})"
            )
        else:
            where = "the loss, the backward pass or the optimizer update (no layer)"
        lines = _ANSI.sub("", str(error)).strip().splitlines()
        detail = " ".join(line.strip() for line in lines if line.strip())
        return NotImplementedError(
            f"PyTorch's DTensor could not run {op} in {where} with the sharded "
            f"variables of this ModelParallel layout. {type(error).__name__}: "
            f"{detail} -- Replicate that layer's variables (leave them out of the "
            "LayoutMap) or shard them along another dimension. Sharded variables: "
            f"{self._sharded_layouts()}"
        )

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        outermost = self._depth == 0
        self._depth += 1
        if not outermost:
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._layers.clear()
        # Keras' frames stay in tracebacks, so a failure can name the op.
        filtering = keras.config.is_traceback_filtering_enabled()
        if filtering:
            keras.config.disable_traceback_filtering()
        try:
            # Plain compute: a layer's whole weights are freed after its
            # forward, gathered again in its backward (see `Regather`).
            resharding = (
                self._plain.reshard_hooks()
                if self._plain is not None
                else contextlib.nullcontext()
            )
            with implicit_replication(), _attention_kernels(), resharding:
                yield
        except NotImplementedError:
            raise
        except Exception as error:
            # Plain compute runs no DTensor op inside a layer: only an error
            # from DTensor itself is DTensor's.
            in_dtensor_layer = self._plain is None and self._in_sharded_layer()
            if not (_from_dtensor(error) or in_dtensor_layer):
                raise
            raise self._failure(error) from error
        finally:
            self._depth -= 1
            self._release_all_variables()
            if filtering:
                keras.config.enable_traceback_filtering()

    def wrap_steps(self, steps: dict[str, Callable]) -> dict[str, Callable]:
        """The step functions, each run with plain tensors acting as replicated
        DTensors and DTensor failures reported by op and layer."""

        def wrap(step: Callable) -> Callable:
            def run(*args: Any, **kwargs: Any) -> Any:
                with self._step():
                    return step(*args, **kwargs)

            return run

        return {name: wrap(step) for name, step in steps.items()}


def collectives(run: ShardedRun) -> internals.Collectives:
    """The steps' collectives: none are needed, every process sees the whole
    batch and DTensor (or `fsdp_compute`) brings its own."""

    def start_sum(tensor: Any) -> Callable[[], None]:
        return lambda: None

    return internals.Collectives(
        world_size=1,
        start_sum=start_sum,
        gather_from_processes=lambda tensor: tensor,
        # DTensor's gradients are already those of the whole batch.
        average_gradients=lambda gradients: gradients,
        forward=run.model,
        no_grad=run.optimizer_update,
        loss_scope=run.loss_scope,
    )
