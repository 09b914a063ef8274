"""The candidates `keras_dist.plan_search` compiles: a policy, a mesh shape
and a remat setting each, and the function of the mesh that makes each one's
distribution for a model.

    data_parallel  DataParallel on {"batch": N}
    fsdp           FSDP on {"batch": N}
    fsdp_tp        FSDP x tensor parallel on {"batch": N / m, "model": m}: the
                   KerasHub backbone's own layout map (`layouts.for_keras_hub`)
                   or, for other models, `layouts.tensor_parallel`, with FSDP
                   splitting what the map leaves along "batch"

each with remat off and on ("blocks": each transformer block of a KerasHub
model recomputed as one piece; "full" otherwise). `m` runs over the powers
of two that divide the device count, the model's attention heads and its
width, smallest first.

Context parallelism (`sequence_axis_sizes`): FSDP with `sequence_axis="seq"`
on {"batch": N / s, "seq": s}, remat off and on, where all of these hold:

    - the model has attention keras_dist can split along a sequence axis
      (`distribution.sequence.attention_layers`);
    - its inputs' sequence length L is known and long: L >= `LONG_SEQUENCE`
      (1024), or one attention layer's scores for the rows a device holds
      under the batch axis alone (rows x heads x L x L x 4 bytes) take
      `SCORES_SHARE` (an eighth) of a device's memory or more;
    - s is a power of two from 2 that divides the device count and L, and
      leaves a batch axis the slice count divides;
    - the split lowers the tokens a device holds: ceil(B / (N / s)) / s rows
      of L tokens, fewer than under the batch axis alone (ceil(B / N)) and
      than with every smaller s (a larger s that holds as many only adds
      all-gathers). With a global batch B of N or more sequences (a
      multiple of N) every device holds B / N whole sequences either way,
      and a sequence axis only adds the keys' and values' all-gathers: not
      tried.

Memory savers (`savers`): where a candidate with nothing recomputed or
offloaded does not fit, or fits with less than `CLOSE` of the memory to
spare, the search adds its variants that keep less on the device, those the
installed keras_dist takes: remat "dots" (matmul outputs kept, the rest
recomputed), optimizer state in bfloat16, optimizer state offloaded to the
host, and remat "offload" (kept activations offloaded).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import keras

# The module itself: `from keras_dist import layouts` would ask the package's
# public API, which may be loading this module.
import keras_dist.layouts as layouts
from keras_dist.distribution.policies import FSDP, DataParallel
from keras_dist.distribution.remat import REMAT_POLICIES, check_remat
from keras_dist.distribution.sequence import attention_layers
from keras_dist.distribution.swapped_axes import model_width
from keras_dist.keras_compat.layers import layers_of
from keras_dist.planner.model import input_specs
from keras_dist.planner.paper_mesh import check_mesh

POLICIES = ("data_parallel", "fsdp", "fsdp_tp")
#: `Candidate.remat`: off, Keras' modes, "blocks" (each transformer block of
#: a KerasHub model, `keras.RematScope(mode="list_of_layers")`), or a named
#: policy of `keras_dist.distribution.remat.REMAT_POLICIES` ("dots",
#: "offload": the pieces of "full", each keeping what the policy names).
REMAT = (
    None,
    "full",
    "activations",
    "larger_than",
    "blocks",
    *(name for name in REMAT_POLICIES if name != "full"),
)
#: `Candidate.offload` and `Candidate.optimizer_state_dtype`'s values.
OFFLOAD = (None, "optimizer")
STATE_DTYPES = (None, "bfloat16")
#: A candidate fits "closely" with less than this share of the memory spare.
CLOSE = 0.05
BATCH_AXIS = "batch"
MODEL_AXIS = "model"
#: The mesh axis of context parallelism (FSDP's `sequence_axis=`).
SEQUENCE_AXIS = "seq"
#: Sequences at least this long get sequence-axis candidates.
LONG_SEQUENCE = 1024
#: ...as do shorter ones whose attention scores per device take this share
#: of a device's memory under the batch axis alone.
SCORES_SHARE = 1 / 8
_LABELS = {
    "data_parallel": "DataParallel",
    "fsdp": "FSDP",
    "fsdp_tp": "FSDP x TP",
}


@dataclass(frozen=True)
class Candidate:
    """One distribution `keras_dist.plan_search` compiles.

    Attributes:
        policy: `"data_parallel"`, `"fsdp"` or `"fsdp_tp"` (FSDP along
            `"batch"` with a tensor-parallel layout map along `"model"`).
        mesh: `{"batch": d}` or `{"batch": d, "model": m}`, data axis first;
            for data_parallel and fsdp also `{"batch": d, "seq": s}`: each
            sequence split along `"seq"` (the distribution's
            `sequence_axis="seq"`, context parallelism).
        remat: None (off), a Keras remat mode (`"full"`, `"activations"`,
            `"larger_than"`), `"blocks"`: each transformer block of a
            KerasHub model (its backbone's `transformer_layers`) recomputed,
            or a named policy, `"dots"` or `"offload"` (the distribution's
            `remat=`).
        offload: None or `"optimizer"`: the optimizer's state in the host's
            memory (the distribution's `offload=`).
        optimizer_state_dtype: None (the variables' dtype) or `"bfloat16"`
            (the distribution's `optimizer_state_dtype=`).

    Example:

    >>> candidate = Candidate("fsdp_tp", {"batch": 64, "model": 4}, remat="blocks")
    >>> candidate.description
    'FSDP x TP, batch=64 model=4, remat blocks'
    """

    policy: str
    mesh: Mapping[str, int] = field(hash=False)
    remat: str | None = None
    offload: str | None = None
    optimizer_state_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"`policy` must be one of {POLICIES}. Received: policy={self.policy!r}"
            )
        check_mesh(self.mesh)
        object.__setattr__(self, "mesh", {str(a): int(s) for a, s in self.mesh.items()})
        axes = list(self.mesh)
        allowed = (
            [[BATCH_AXIS, MODEL_AXIS]]
            if self.policy == "fsdp_tp"
            else [[BATCH_AXIS], [BATCH_AXIS, SEQUENCE_AXIS]]
        )
        if axes not in allowed:
            raise ValueError(
                f"A candidate's mesh is {{'{BATCH_AXIS}': d}}, "
                f"{{'{BATCH_AXIS}': d, '{SEQUENCE_AXIS}': s}} (a sequence axis) "
                f"or, for fsdp_tp, {{'{BATCH_AXIS}': d, '{MODEL_AXIS}': m}}. "
                f"Received: policy={self.policy!r}, mesh={self.mesh!r}"
            )
        if self.remat not in REMAT:
            raise ValueError(
                f"`remat` must be one of {REMAT}. Received: remat={self.remat!r}"
            )
        if self.offload not in OFFLOAD:
            raise ValueError(
                f"`offload` must be one of {OFFLOAD}. Received: "
                f"offload={self.offload!r}"
            )
        if self.optimizer_state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"`optimizer_state_dtype` must be one of {STATE_DTYPES}. "
                f"Received: optimizer_state_dtype={self.optimizer_state_dtype!r}"
            )

    @property
    def sequence_axis(self) -> str | None:
        """`"seq"` where the mesh has a sequence axis, else None."""
        return SEQUENCE_AXIS if SEQUENCE_AXIS in self.mesh else None

    @property
    def label(self) -> str:
        label = _LABELS[self.policy]
        return f"{label} x sequence" if self.sequence_axis else label

    @property
    def mesh_text(self) -> str:
        return " ".join(f"{axis}={size}" for axis, size in self.mesh.items())

    @property
    def description(self) -> str:
        text = f"{self.label}, {self.mesh_text}, remat {self.remat or 'off'}"
        if self.offload:
            text += f", offload {self.offload}"
        if self.optimizer_state_dtype:
            text += f", {self.optimizer_state_dtype} optimizer state"
        return text

    @property
    def plain(self) -> bool:
        """Nothing recomputed, offloaded or stored in a smaller dtype."""
        return self == self.twin

    @property
    def twin(self) -> Candidate:
        """The same policy and mesh with remat off, nothing offloaded."""
        return Candidate(self.policy, self.mesh)

    def to_dict(self) -> dict[str, Any]:
        made = {"policy": self.policy, "mesh": dict(self.mesh), "remat": self.remat}
        # Only where set: a plain candidate keeps its cache key.
        if self.offload:
            made["offload"] = self.offload
        if self.optimizer_state_dtype:
            made["optimizer_state_dtype"] = self.optimizer_state_dtype
        if self.sequence_axis:
            made["sequence_axis"] = self.sequence_axis
        return made

    def savers(self) -> list[Candidate]:
        """This plain candidate's variants that keep less on the device,
        those the installed keras_dist takes (see the module's docstring)."""
        if not self.plain:
            return []
        made = []
        if remat_policy_known("dots"):
            made.append(Candidate(self.policy, self.mesh, remat="dots"))
        for name, value in (
            ("optimizer_state_dtype", "bfloat16"),
            ("offload", "optimizer"),
        ):
            if distributions_take(name):
                made.append(Candidate(self.policy, self.mesh, **{name: value}))
        if remat_policy_known("offload"):
            made.append(Candidate(self.policy, self.mesh, remat="offload"))
        return made

    def distribution_function(self, model: Any) -> Callable[[Any], Any]:
        """The function of the `DeviceMesh` that makes this candidate's
        distribution for `model` (built: a tensor-parallel layout map is
        read from its variables)."""
        remat = remat_scope(model, self.remat)
        policy = self.policy
        # Only where set: keras_dist's without these arguments still plans.
        options: dict[str, Any] = {"remat": remat}
        if self.offload:
            options["offload"] = self.offload
        if self.optimizer_state_dtype:
            options["optimizer_state_dtype"] = self.optimizer_state_dtype
        if self.sequence_axis:
            options["sequence_axis"] = self.sequence_axis

        def make(mesh: Any) -> Any:
            if policy == "data_parallel":
                return DataParallel(mesh, **options)
            layout_map = (
                tensor_parallel_map(model, mesh) if policy == "fsdp_tp" else None
            )
            return FSDP(mesh, axis=BATCH_AXIS, layout_map=layout_map, **options)

        return make


def remat_policy_known(name: str) -> bool:
    """Whether the distributions take `remat=name`."""
    try:
        check_remat(name)
    except (ValueError, NotImplementedError):
        return False
    return True


def distributions_take(name: str) -> bool:
    """Whether the distributions take the keyword argument `name`."""
    return all(
        name in inspect.signature(policy.__init__).parameters
        for policy in (DataParallel, FSDP)
    )


def keras_hub_backbone(model: Any) -> Any:
    """The KerasHub backbone `model` is or holds (a task's `backbone`), or None."""
    for owner in (model, getattr(model, "backbone", None)):
        if (
            isinstance(owner, keras.Model)
            and type(owner).__module__.startswith("keras_hub")
            and hasattr(type(owner), "get_layout_map")
        ):
            return owner
    return None


def tensor_parallel_map(model: Any, mesh: Any) -> Any:
    """KerasHub's own layout map for a KerasHub model, else Megatron-style
    tensor parallelism of its Dense, attention and embedding layers."""
    backbone = keras_hub_backbone(model)
    if backbone is not None:
        return layouts.for_keras_hub(
            backbone, mesh, model_axis=MODEL_AXIS, data_axis=BATCH_AXIS
        )
    return layouts.tensor_parallel(model, mesh, model_axis=MODEL_AXIS)


def transformer_blocks(model: Any) -> list[str]:
    """The names of a KerasHub model's transformer blocks (its backbone's
    `transformer_layers`), or [] for other models."""
    for owner in (model, getattr(model, "backbone", None)):
        blocks = getattr(owner, "transformer_layers", None)
        if isinstance(blocks, (list, tuple)) and blocks:
            return [block.name for block in blocks]
    return []


def remat_scope(model: Any, remat: str | None) -> Any:
    """What a distribution's `remat=` takes for a candidate's `remat`."""
    if remat != "blocks":
        return remat
    names = transformer_blocks(model)
    if not names:
        raise ValueError(
            "remat='blocks' recomputes a KerasHub model's transformer blocks (its "
            f"backbone's `transformer_layers`); model {model.name!r} has none. Use "
            "remat='full'."
        )
    return keras.RematScope(mode="list_of_layers", layer_names=names)


def attention_heads(model: Any) -> int | None:
    """The attention heads a model axis must divide: a KerasHub backbone's
    query heads, else the common divisor of its MultiHeadAttention layers'
    heads; None when it has none."""
    for owner in (model, getattr(model, "backbone", None)):
        for name in ("num_query_heads", "num_heads"):
            heads = getattr(owner, name, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
                return heads
    counts = [
        layer.num_heads
        for layer in layers_of(model)
        if isinstance(layer, keras.layers.MultiHeadAttention)
    ]
    return math.gcd(*counts) if counts else None


def model_axis_sizes(model: Any, devices: int, num_slices: int = 1) -> list[int]:
    """The sizes of a model axis worth trying: powers of two from 2 that
    divide the device count, the attention heads and the model's width,
    leaving a batch axis the slice count divides."""
    heads = attention_heads(model)
    width = model_width(model, [(v.path, tuple(v.shape)) for v in model.weights])
    sizes = []
    size = 2
    while size <= devices:
        if (
            devices % size == 0
            and (devices // size) % num_slices == 0
            and (heads is None or heads % size == 0)
            and (width is None or width % size == 0)
        ):
            sizes.append(size)
        size *= 2
    return sizes


def sequence_length_of(
    model: Any, input_shape: Any = None, sequence_length: int | None = None
) -> int | None:
    """The sequence length of `model`'s inputs: the second dimension of its
    first input of rank 2 or more (with `input_shape` or `sequence_length`
    as `keras_dist.plan` reads them), or None where unknown or 1."""
    specs = input_specs(model, input_shape, sequence_length)
    if specs is None:
        specs = getattr(model, "inputs", None)
    for tensor in keras.tree.flatten(specs) if specs is not None else []:
        shape = tuple(getattr(tensor, "shape", ()))
        if len(shape) >= 2 and isinstance(shape[1], int) and shape[1] > 1:
            return shape[1]
    return None


def sequence_axis_sizes(
    model: Any,
    devices: int,
    num_slices: int = 1,
    *,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    memory: int | None = None,
) -> list[int]:
    """The sizes of a sequence axis worth trying (the module's rule), smallest
    first; [] where the sequence is too short or the model has no attention
    to split."""
    length = sequence_length
    if length is None or batch_size is None or not attention_layers(model):
        return []
    rows = -(-batch_size // devices)
    heads = attention_heads(model) or 1
    scores = rows * heads * length * length * 4
    if length < LONG_SEQUENCE and (memory is None or scores < SCORES_SHARE * memory):
        return []
    sizes = []
    size, held = 2, rows  # rows of whole sequences a device holds
    while size <= devices:
        batch_axis = devices // size
        if devices % size == 0 and length % size == 0 and batch_axis % num_slices == 0:
            split = -(-batch_size // batch_axis) / size
            if split < held:
                sizes.append(size)
                held = split
        size *= 2
    return sizes


def default_candidates(
    model: Any, devices: int, num_slices: int = 1, **sequence: Any
) -> list[Candidate]:
    """Every candidate for `model` on `devices` devices, in the order they are
    tried: data parallel, FSDP, FSDP x TP by growing model axis, then FSDP
    with a sequence axis by growing size (`sequence`: `sequence_axis_sizes`'
    keyword arguments); each with remat off, then on."""
    remat = "blocks" if transformer_blocks(model) else "full"
    whole = {BATCH_AXIS: devices}
    meshes = [("data_parallel", whole), ("fsdp", whole)] + [
        ("fsdp_tp", {BATCH_AXIS: devices // size, MODEL_AXIS: size})
        for size in model_axis_sizes(model, devices, num_slices)
    ]
    meshes += [
        ("fsdp", {BATCH_AXIS: devices // size, SEQUENCE_AXIS: size})
        for size in sequence_axis_sizes(model, devices, num_slices, **sequence)
    ]
    return [
        Candidate(policy, mesh, setting)
        for policy, mesh in meshes
        for setting in (None, remat)
    ]


def chosen_candidates(
    given: Any, model: Any, devices: int, num_slices: int, **sequence: Any
) -> list[Candidate]:
    """`plan_search`'s `candidates`: None (every default one), policy names
    (the default ones of those policies) or `Candidate`s, checked against the
    topology's device count. `sequence`: `sequence_axis_sizes`' keyword
    arguments."""
    if given is None:
        return default_candidates(model, devices, num_slices, **sequence)
    if isinstance(given, (str, Candidate)) or not isinstance(given, (list, tuple)):
        raise TypeError(
            "`candidates` must be a list of policy names "
            f"{POLICIES} or of keras_dist.planner.Candidate. Received: "
            f"candidates={given!r}"
        )
    if not given:
        raise ValueError("`candidates` must name at least one. Received: []")
    if all(isinstance(item, str) for item in given):
        unknown = [name for name in given if name not in POLICIES]
        if unknown:
            raise ValueError(
                f"Unknown policies {unknown} in `candidates`: give some of "
                f"{POLICIES}. Received: candidates={given!r}"
            )
        return [
            candidate
            for candidate in default_candidates(model, devices, num_slices, **sequence)
            if candidate.policy in given
        ]
    if not all(isinstance(item, Candidate) for item in given):
        raise TypeError(
            "`candidates` must be all policy names or all Candidates. Received: "
            f"candidates={given!r}"
        )
    for candidate in given:
        count = math.prod(candidate.mesh.values())
        if count != devices:
            raise ValueError(
                f"Candidate {candidate.description!r} has a mesh of {count} "
                f"devices; the topology has {devices}."
            )
        remat_scope(model, candidate.remat)
    return list(given)


__all__ = [
    "CLOSE",
    "Candidate",
    "LONG_SEQUENCE",
    "OFFLOAD",
    "POLICIES",
    "REMAT",
    "SCORES_SHARE",
    "SEQUENCE_AXIS",
    "STATE_DTYPES",
    "attention_heads",
    "chosen_candidates",
    "default_candidates",
    "keras_hub_backbone",
    "model_axis_sizes",
    "remat_scope",
    "sequence_axis_sizes",
    "sequence_length_of",
    "tensor_parallel_map",
    "transformer_blocks",
]
