"""`keras_dist.plan_search`: candidate distributions compiled for a topology
and ranked, on `cpu:8` (8 simulated devices, every JAX run) with a tiny
model; one test on a TPU topology needs `libtpu` (tests/run_tpu_topology.sh).
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import os
import pathlib
import warnings

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist import cli, cli_search
from keras_dist.backends import get_adapter
from keras_dist.planner import Candidate, search_cache
from keras_dist.planner.candidates import (
    default_candidates,
    model_axis_sizes,
    sequence_axis_sizes,
)
from keras_dist.planner.result import CompiledPlan, CompiledStep
from keras_dist.planner.search_result import (
    SearchResult,
    SearchResults,
    render_table,
)

jax_only = pytest.mark.backend("jax")
ROOT = pathlib.Path(__file__).resolve().parents[1]

WIDTH = 128
# The tiny model's variables and Adam's two moments, float32, whole.
WEIGHTS = 64 * WIDTH + WIDTH + WIDTH * WIDTH + WIDTH + WIDTH * 10 + 10
WEIGHTS_AND_MOMENTS = 3 * 4 * WEIGHTS  # 315,000 bytes


def _has_libtpu() -> bool:
    try:
        importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def tiny(picky: bool = False):
    """A compiled MLP whose layers are named, so that a tensor-parallel
    layout made on one copy lays out another (module level: picklable)."""
    layers = [
        keras.Input((64,)),
        keras.layers.Dense(WIDTH, activation="relu", name="hidden"),
        keras.layers.Dense(WIDTH, activation="relu", name="middle"),
        keras.layers.Dense(10, name="head"),
    ]
    if picky:
        layers.insert(2, Picky(name="picky"))
    model = keras.Sequential(layers, name="tiny")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Picky(keras.layers.Layer):
    """A layer that refuses to be traced under FSDP: a candidate that fails
    with an exception of its own, not XLA's."""

    def call(self, inputs):
        if isinstance(keras.distribution.distribution(), kd.FSDP):
            raise RuntimeError("picky refuses FSDP")
        return inputs


def picky_model():
    return tiny(picky=True)


FSDP = Candidate("fsdp", {"batch": 8})
FSDP_TP = Candidate("fsdp_tp", {"batch": 4, "model": 2})
DATA_PARALLEL = Candidate("data_parallel", {"batch": 8})
DP8 = ("data_parallel", {"batch": 8})


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if anything is compiled."""

    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(type(get_adapter()), "compile_steps", refuse)


# -- ranking --------------------------------------------------------------------
@jax_only
def test_candidates_rank_fits_first_then_peak_bytes_on_cpu():
    # The memory holds FSDP's shards, not DataParallel's whole copy and its
    # temporaries (XLA's peak on CPU: about 513 KiB).
    results = kd.plan_search(
        tiny,
        topology="cpu:8",
        batch_size=64,
        device_memory=400_000,
        candidates=[DATA_PARALLEL, FSDP, FSDP_TP],
    )
    ranked = [(r.rank, r.candidate, r.fits) for r in results]
    assert [fits for _, _, fits in ranked] == [True, True, False]
    assert ranked[-1][1] == DATA_PARALLEL and ranked[-1][0] == 3
    first, second = results[0], results[1]
    assert first.peak_bytes <= second.peak_bytes
    assert results.best is first and first.compiled.steps["train"].error is None
    assert all(r.step_seconds is None for r in results)  # no roofline for CPUs
    text = str(results)
    assert "Plan search: tiny on cpu:8" in text
    assert "  no  " in text and " short " in text and "ranked by peak bytes" in text
    assert json.loads(json.dumps(results.to_dict()))["results"][0]["rank"] == 1


def _result(mesh: dict, memory: int, peak: int, step: float | None):
    """A result as a TPU search gives it: XLA's peak, a projected time."""
    figures = CompiledStep("train", 1.0, peak_bytes=peak, step_seconds=step)
    compiled = CompiledPlan("v5e:2x2", "TPU", 4, 1, "f32", {"train": figures}, memory)
    policy = "fsdp_tp" if "model" in mesh else "fsdp"
    return SearchResult(Candidate(policy, mesh), "compiled", compiled=compiled)


@pytest.mark.backend_neutral
def test_fitting_candidates_rank_by_projected_step_time():
    slow_small = _result({"batch": 4}, 100, 10, 0.2)
    fast_large = _result({"batch": 2, "model": 2}, 100, 90, 0.1)
    too_large = _result({"batch": 1, "model": 4}, 100, 200, 0.01)
    failed = SearchResult(Candidate("fsdp", {"batch": 4}, "full"), "failed", error="x")
    results = SearchResults(
        [failed, too_large, slow_small, fast_large], title="t", notes=[], seconds=0
    )
    assert list(results) == [fast_large, slow_small, too_large, failed]
    assert [r.rank for r in results] == [1, 2, 3, None]
    assert results.failed == [failed] and results.best is fast_large
    nothing_fits = SearchResults([too_large], title="t", notes=[], seconds=0)
    assert nothing_fits.best is None


# -- does not fit -----------------------------------------------------------------
def _short(mesh: dict, peak: int, *, remat=None, temp: int = 30, arguments: int = 40):
    figures = CompiledStep(
        "train", 1.0, peak_bytes=peak, temp_bytes=temp, argument_bytes=arguments
    )
    compiled = CompiledPlan("cpu:8", "cpu", 8, 1, "f32", {"train": figures}, 100)
    policy = "fsdp_tp" if "model" in mesh else "fsdp"
    return SearchResult(Candidate(policy, mesh, remat), "compiled", compiled=compiled)


@pytest.mark.backend_neutral
def test_when_nothing_fits_candidates_rank_by_shortfall_then_screened_ones():
    near = _short({"batch": 2, "model": 4}, 120)
    far = _short({"batch": 8}, 300)
    # Two as short as each other: the candidates' own order breaks the tie.
    tie_a = _short({"batch": 4, "model": 2}, 200)
    tie_b = _short({"batch": 1, "model": 8}, 200)
    refused = SearchResult(
        Candidate("fsdp", {"batch": 8}, "full"),
        "compiled",
        compiled=CompiledPlan(
            "cpu:8",
            "cpu",
            8,
            1,
            "f32",
            {"train": CompiledStep("train", 1.0, error="RESOURCE_EXHAUSTED")},
            100,
        ),
    )
    screened_far = SearchResult(
        Candidate("data_parallel", {"batch": 8}), "screened", screened_shortfall=900
    )
    screened_near = SearchResult(
        Candidate("data_parallel", {"batch": 8}, "full"),
        "screened",
        screened_shortfall=500,
    )
    everything = [screened_far, far, tie_b, refused, screened_near, near, tie_a]
    expected = [near, tie_b, tie_a, far, refused, screened_near, screened_far]
    for order in (everything, everything[::-1]):
        results = SearchResults(list(order), title="t", notes=[], seconds=0)
        assert list(results) == expected
    assert [r.shortfall_bytes for r in expected] == [20, 100, 100, 200, None, 500, 900]
    assert results.best is None and results.nearest is near
    text = str(results)
    assert "short" in text.splitlines()[1]  # a column of its own
    assert (
        "Nothing fits. The nearest: FSDP x TP, batch=2 model=4, remat off, 20 B "
        in (text)
    )
    results = SearchResults(
        [near, far], title="t", notes=[], seconds=0, batch_size=64, num_slices=1
    )
    steps = "\n".join(results.next_steps())
    assert "a smaller batch (batch_size=32)" in steps
    assert "Candidate('fsdp_tp', {'batch': 2, 'model': 4}, remat='full')" in steps
    assert "num_slices=2, or a topology= of more chips" in steps
    # The command says them as its flags.
    flags = {**cli.PLAN_FLAGS, **cli_search.SEARCH_FLAGS}
    said = render_table(results, lambda text: cli.as_flags(text, flags))
    assert "a smaller batch (--batch-size 32)" in said
    assert "--num-slices 2, or a --topology of more chips" in said
    # A remat twin that was compiled is not suggested again; one the budget
    # skipped is named with why.
    twin = _short({"batch": 2, "model": 4}, 130, remat="full")
    assert "- remat" not in "".join(
        SearchResults([near, twin], title="t", notes=[], seconds=0).next_steps()
    )
    skipped = SearchResult(
        Candidate("fsdp_tp", {"batch": 2, "model": 4}, "full"),
        "skipped",
        reason="not tried: the time budget of 1 s was spent",
    )
    assert "remat full was not tried: the time budget" in "".join(
        SearchResults([near, skipped], title="t", notes=[], seconds=0).next_steps()
    )
    # Only state too large for the memory: more chips, nothing else.
    alone = SearchResults([screened_near], title="t", notes=[], seconds=0).next_steps()
    assert len(alone) == 2 and "its variables and optimizer state alone" in alone[1]


@jax_only
def test_nothing_fits_ranks_the_same_from_run_to_run_in_worker_processes():
    def search():
        return kd.plan_search(
            tiny,
            topology="cpu:8",
            batch_size=64,
            device_memory=60_000,
            processes=2,
            candidates=[DATA_PARALLEL, FSDP, FSDP_TP],
        )

    first, second = search(), search()
    assert first.best is None
    orders = [[r.candidate for r in results] for results in (first, second)]
    assert orders[0] == orders[1]
    assert orders[0][-1] == DATA_PARALLEL  # screened: after the compiled ones
    shortfalls = [r.shortfall_bytes for r in first]
    assert all(short > 0 for short in shortfalls)
    assert shortfalls[:2] == sorted(shortfalls[:2])
    assert first.nearest is first[0]
    assert "Nothing fits. The nearest: " in str(first)


@jax_only
def test_a_candidate_too_large_is_reported_as_not_fitting_and_remat_tried():
    # Below the weights and moments per device: DataParallel is out before
    # it compiles; FSDP's eighth is well within.
    results = kd.plan_search(
        tiny,
        topology="cpu:8",
        batch_size=64,
        device_memory=WEIGHTS_AND_MOMENTS // 2,
        candidates=["data_parallel", "fsdp"],
    )
    by = {
        (r.policy, r.remat): r
        for r in results
        if not (r.candidate.offload or r.candidate.optimizer_state_dtype)
    }
    screened = by[("data_parallel", None)]
    assert screened.status == "screened" and screened.fits is False
    assert "variables and optimizer state alone need" in screened.reason
    assert screened.compiled is None
    # The remat twin of a candidate that does not fit is tried; that of one
    # that fits is not (recomputing only adds time).
    assert by[("data_parallel", "full")].status == "screened"
    assert by[("fsdp", None)].fits is True
    skipped = by[("fsdp", "full")]
    assert skipped.status == "skipped" and "remat off fits" in skipped.reason
    assert "no (static)" in str(results)
    # What does not fit gets its memory savers; what fits roomily does not.
    savers = {r.candidate: r for r in results if r.policy == "data_parallel"}
    offloaded = Candidate("data_parallel", {"batch": 8}, offload="optimizer")
    half = Candidate("data_parallel", {"batch": 8}, optimizer_state_dtype="bfloat16")
    assert set(savers) >= {offloaded, half, Candidate(*DP8, remat="dots")}
    # Its moments live on the host: not screened, compiled, and moved.
    assert savers[offloaded].status == "compiled", savers[offloaded]
    train = savers[offloaded].compiled.steps["train"]
    assert train.host_to_device_bytes >= 2 * 4 * WEIGHTS  # both moments, in
    assert train.device_to_host_bytes >= 2 * 4 * WEIGHTS  # and out
    assert savers[half].status == "screened"  # weights + bf16 moments > memory
    assert not [
        r
        for r in results
        if r.policy == "fsdp" and not r.candidate.plain and r.remat is None
    ]
    assert "offload optimizer" in str(results)


@jax_only
def test_savers_are_not_added_to_candidates_given():
    results = kd.plan_search(
        tiny,
        topology="cpu:8",
        batch_size=64,
        device_memory=WEIGHTS_AND_MOMENTS // 2,
        candidates=[DATA_PARALLEL],
    )
    assert [r.candidate for r in results] == [DATA_PARALLEL]


@pytest.mark.backend_neutral
def test_candidates_refuse_unknown_offload_and_state_dtypes():
    with pytest.raises(ValueError, match="`offload` must be one of"):
        Candidate(*DP8, offload="everything")
    with pytest.raises(ValueError, match="`optimizer_state_dtype` must be one of"):
        Candidate(*DP8, optimizer_state_dtype="int8")
    saver = Candidate(*DP8, offload="optimizer", optimizer_state_dtype="bfloat16")
    assert saver.description.endswith(
        "remat off, offload optimizer, bfloat16 optimizer state"
    )
    assert saver.twin == DATA_PARALLEL and not saver.plain and DATA_PARALLEL.plain
    assert saver.savers() == []  # only a plain candidate has savers
    assert DATA_PARALLEL.to_dict() == {
        "policy": "data_parallel",
        "mesh": {"batch": 8},
        "remat": None,
    }


# -- the largest batch ------------------------------------------------------------
@pytest.mark.backend_neutral
def test_the_largest_batch_doubles_then_bisects_in_steps(monkeypatch):
    from keras_dist.planner import batch_search  # noqa: PLC0415

    asked = []

    def fits_at(batch):
        asked.append(batch)
        return batch <= 100

    found = batch_search.largest_batch(FSDP, fits_at, 8, 8, None)
    assert (found.batch_size, found.too_large) == (96, 104) and found.exact
    assert asked[:4] == [16, 32, 64, 128] and len(asked) <= batch_search.MAX_COMPILES
    assert "fits FSDP, batch=8, remat off: 96 (104 does not)" in str(found)
    monkeypatch.setattr(batch_search, "MAX_COMPILES", 2)
    capped = batch_search.largest_batch(FSDP, fits_at, 8, 8, None)
    assert capped.batch_size == 32 and capped.too_large is None
    assert "stopped after 2 compiles" in str(capped) and not capped.exact
    unknown = batch_search.largest_batch(FSDP, lambda batch: None, 8, 8, None)
    assert "whether batch 16 fits is not known" in str(unknown)
    spent = batch_search.largest_batch(FSDP, fits_at, 8, 8, 0.0)
    assert "the time budget was spent" in str(spent) and spent.batch_size == 8


@jax_only
def test_the_largest_batch_that_fits_is_found_by_compiling():
    small = kd.plan(tiny, kd.FSDP, topology="cpu:8", batch_size=64)
    large = kd.plan(tiny, kd.FSDP, topology="cpu:8", batch_size=128)
    memory = (small.compiled.peak_bytes + large.compiled.peak_bytes) // 2
    results = kd.plan_search(
        tiny,
        topology="cpu:8",
        batch_size=64,
        device_memory=memory,
        candidates=[FSDP],
        largest_batch=True,
    )
    found = results.largest_batch
    assert found.candidate == FSDP and 64 <= found.batch_size < 128
    assert len(found.tried) <= 4  # 128, then halving 64 to 128 in steps of 8
    assert found.exact and found.too_large - found.batch_size == 8, found
    assert str(found) in str(results)
    at = kd.plan(
        tiny,
        kd.FSDP,
        topology="cpu:8",
        batch_size=found.batch_size,
        device_memory=memory,
    )
    above = kd.plan(
        tiny,
        kd.FSDP,
        topology="cpu:8",
        batch_size=found.too_large,
        device_memory=memory,
    )
    assert at.fits is True and above.fits is False
    # Nothing known to fit: nothing searched, and said.
    unknown = kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, candidates=[FSDP], largest_batch=True
    )
    assert unknown.largest_batch is None
    assert "largest_batch=True: not searched" in str(unknown)


# -- the time budget --------------------------------------------------------------
@jax_only
def test_the_time_budget_stops_starting_candidates_and_says_which():
    results = kd.plan_search(
        tiny,
        topology="cpu:8",
        batch_size=64,
        time_budget=1e-3,
        candidates=[FSDP, DATA_PARALLEL, FSDP_TP],
    )
    compiled = [r.candidate for r in results if r.status == "compiled"]
    assert compiled == [FSDP]  # the first always starts
    assert [r.candidate for r in results.not_tried] == [DATA_PARALLEL, FSDP_TP]
    assert all("time budget of 0.001 s" in r.reason for r in results.not_tried)
    assert str(results).count("skipped") == 2


# -- the cache --------------------------------------------------------------------
@jax_only
def test_the_cache_is_hit_on_the_second_call(tmp_path, monkeypatch):
    first = kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, cache_dir=tmp_path, candidates=[FSDP]
    )
    assert [r.status for r in first] == ["compiled"]
    assert len(list(tmp_path.glob("*.json"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(type(get_adapter()), "compile_steps", refuse)
    # The same model made again, with another memory.
    again = kd.plan_search(
        tiny,
        topology="cpu:8",
        batch_size=64,
        cache_dir=tmp_path,
        candidates=[FSDP],
        device_memory=10,
    )
    hit = again[0]
    assert hit.status == "cached" and hit.error is None
    assert hit.peak_bytes == first[0].peak_bytes
    assert hit.fits is False  # decided again from this search's memory
    assert "(cached)" in str(again)
    assert hit.distribution.device_mesh.shape == (8,)
    # Another batch size is another program: not from the cache.
    other = kd.plan_search(
        tiny, topology="cpu:8", batch_size=32, cache_dir=tmp_path, candidates=[FSDP]
    )
    assert other[0].status == "failed" and "compiled again" in other[0].error


def unnamed():
    """A model whose layers Keras names (`dense_3`...): each one made gets
    new names."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@jax_only
def test_the_cache_key_leaves_out_automatic_names(tmp_path, monkeypatch):
    # cache_dir=True: $XDG_CACHE_HOME/keras_dist/plans.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = kd.plan_search(
        unnamed, topology="cpu:8", batch_size=8, cache_dir=True, candidates=[FSDP]
    )
    assert first[0].status == "compiled"
    assert len(list((tmp_path / "keras_dist" / "plans").glob("*.json"))) == 1
    again = kd.plan_search(
        unnamed, topology="cpu:8", batch_size=8, cache_dir=True, candidates=[FSDP]
    )
    assert again[0].status == "cached"


@jax_only
def test_an_unreadable_cache_entry_is_compiled_again(tmp_path):
    kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, cache_dir=tmp_path, candidates=[FSDP]
    )
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    again = kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, cache_dir=tmp_path, candidates=[FSDP]
    )
    assert again[0].status == "compiled"
    assert json.loads(entry.read_text())["format"] == search_cache.FORMAT


# -- the distribution, in a real fit ------------------------------------------------
@jax_only
def test_the_best_distribution_trains_a_real_model_on_cpu8():
    results = kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, candidates=[FSDP_TP]
    )
    distribution = results.best.distribution
    assert isinstance(distribution, kd.FSDP)
    mesh = distribution.device_mesh
    assert dict(zip(mesh.axis_names, mesh.shape, strict=True)) == {
        "batch": 4,
        "model": 2,
    }
    model = tiny()
    x = np.random.rand(64, 64).astype("float32")
    y = np.random.randint(0, 10, 64)
    history = model.fit(
        x,
        y,
        batch_size=64,
        epochs=2,
        verbose=0,
        callbacks=[kd.DistributeCallback(distribution)],
    )
    assert np.isfinite(history.history["loss"]).all()
    kernel = model.get_layer("hidden").kernel.value
    assert "model" in str(kernel.sharding.spec)


def auto_named():
    """A compiled model of layers Keras names itself (`embedding`, `dense`,
    `dense_1`...: each build in a process numbers them further)."""
    model = keras.Sequential(
        [
            keras.Input((8,), dtype="int32"),
            keras.layers.Embedding(64, 32),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64),
            keras.layers.Dense(8),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@jax_only
def test_the_searched_layouts_lay_out_the_model_built_again():
    results = kd.plan_search(
        auto_named, topology="cpu:8", batch_size=32, candidates=[FSDP_TP]
    )
    distribution = results.best.distribution
    keys = list(distribution.layout_map)
    # Named as the model numbers its layers, whatever the process built before.
    assert keys[:2] == [
        "^sequential/embedding/embeddings$",
        "^sequential/dense/kernel$",
    ]
    assert "^sequential/dense_4/kernel$" in keys
    auto_named()  # another build in between: the next one's names differ more
    model = auto_named()
    assert model.layers[2].kernel.path != "sequential/dense/kernel"
    x = np.random.randint(0, 64, (64, 8))
    y = np.random.randint(0, 8, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x,
            y,
            batch_size=32,
            verbose=0,
            callbacks=[kd.DistributeCallback(distribution)],
        )
    assert [str(w.message) for w in caught if "LayoutMap key" in str(w.message)] == []
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    split = [
        layer.name
        for layer in dense
        if "model" in str(layer.kernel.value.sharding.spec)
    ]
    assert len(split) == 5, [str(layer.kernel.value.sharding.spec) for layer in dense]
    plan = kd.plan(model, distribution, batch_size=32)
    assert [p for p in plan.problems if p.kind == "unmatched-key"] == []
    rows = {row.path: row for row in plan.rows}
    assert rows[model.layers[0].embeddings.path].key == keys[0]


# -- failures ---------------------------------------------------------------------
@jax_only
def test_a_failing_candidate_is_recorded_not_raised():
    results = kd.plan_search(
        picky_model,
        topology="cpu:8",
        batch_size=64,
        candidates=[DATA_PARALLEL, FSDP],
    )
    by = {r.candidate: r for r in results}
    assert by[DATA_PARALLEL].status == "compiled" and by[DATA_PARALLEL].rank == 1
    failed = by[FSDP]
    assert failed.status == "failed" and failed.rank is None
    assert "train step failed" in failed.error and "picky refuses FSDP" in failed.error
    assert results.failed == [failed]
    assert "picky refuses FSDP" in str(results)


@jax_only
def test_an_exception_making_a_candidate_is_recorded_with_its_type(monkeypatch):
    def broken(model, mesh, model_axis):
        raise RuntimeError("no layout today")

    monkeypatch.setattr(kd.layouts, "tensor_parallel", broken)
    results = kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, candidates=[FSDP_TP, FSDP]
    )
    failed = results.failed[0]
    assert failed.candidate == FSDP_TP
    assert failed.error == "RuntimeError: no layout today"
    assert results.best.candidate == FSDP


@jax_only
@pytest.mark.parametrize(
    "arguments, error, words",
    [
        ({"topology": "v9x:2x2"}, ValueError, "Unknown topology"),
        ({"topology": 8}, TypeError, "`topology` must be a string"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be a positive int"),
        ({"batch_size": None}, ValueError, "`batch_size` must be a positive int"),
        ({"time_budget": -1}, ValueError, "`time_budget` must be a positive number"),
        ({"time_budget": True}, ValueError, "`time_budget` must be a positive number"),
        ({"processes": 0}, ValueError, "`processes` must be a positive int"),
        ({"steps": ("fit",)}, ValueError, "`steps` must name some of"),
        ({"cache_dir": 3}, TypeError, "`cache_dir` must be a directory"),
        ({"candidates": "fsdp"}, TypeError, "`candidates` must be a list"),
        ({"candidates": []}, ValueError, "at least one"),
        ({"candidates": ["zero"]}, ValueError, "Unknown policies"),
        ({"candidates": [FSDP, "fsdp"]}, TypeError, "all policy names or all"),
        (
            {"candidates": [Candidate("fsdp", {"batch": 4})]},
            ValueError,
            "mesh of 4 devices; the topology has 8",
        ),
        (
            {"candidates": [Candidate("fsdp", {"batch": 8}, remat="blocks")]},
            ValueError,
            "remat='blocks' recomputes a KerasHub model's transformer blocks",
        ),
    ],
)
def test_bad_arguments_are_refused_before_compiling(
    no_compile, arguments, error, words
):
    given = {"topology": "cpu:8", "batch_size": 64, **arguments}
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        kd.plan_search(tiny, **given)


@jax_only
def test_an_uncompiled_model_is_refused_before_compiling(no_compile):
    def uncompiled():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

    with pytest.raises(ValueError, match="needs a compiled model"):
        kd.plan_search(uncompiled, topology="cpu:8", batch_size=8)


@pytest.mark.backend_neutral
@pytest.mark.parametrize(
    "arguments, words",
    [
        (("zero", {"batch": 8}), "`policy` must be one of"),
        (("fsdp", {"batch": 8}, "some"), "`remat` must be one of"),
        (("fsdp", {"data": 8}), "A candidate's mesh is"),
        (("fsdp_tp", {"batch": 8}), "A candidate's mesh is"),
        (("fsdp", {"batch": 0}), "`mesh` must be a dict"),
    ],
)
def test_bad_candidates_are_refused(arguments, words):
    with pytest.raises(ValueError, match=words):
        Candidate(*arguments)


@pytest.mark.backend("torch", "tensorflow")
def test_other_backends_are_told_the_search_needs_jax():
    with pytest.raises(NotImplementedError, match="needs the JAX backend"):
        kd.plan_search(tiny, topology="cpu:2", batch_size=8)


# -- the candidates -------------------------------------------------------------------
@pytest.mark.backend_neutral
def test_model_axes_divide_the_devices_heads_and_width():
    inputs = keras.Input((16, 64))
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(inputs, inputs)
    model = keras.Model(inputs, keras.layers.Dense(64)(attended))
    assert model_axis_sizes(model, 16) == [2, 4]  # 8 does not divide 4 heads
    assert model_axis_sizes(model, 16, num_slices=4) == [2, 4]
    assert model_axis_sizes(model, 16, num_slices=16) == []
    candidates = default_candidates(model, 16)
    assert [(c.policy, c.mesh, c.remat) for c in candidates[:2]] == [
        ("data_parallel", {"batch": 16}, None),
        ("data_parallel", {"batch": 16}, "full"),
    ]
    assert [c.mesh for c in candidates if c.policy == "fsdp_tp"][::2] == [
        {"batch": 8, "model": 2},
        {"batch": 4, "model": 4},
    ]


def tiny_gemma():
    import keras_hub  # noqa: PLC0415

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=256,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@jax_only
def test_a_keras_hub_model_gets_its_own_layout_map_and_blocks_recomputed():
    pytest.importorskip("keras_hub")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = tiny_gemma()
    assert [(c.policy, c.mesh, c.remat) for c in default_candidates(made, 8)][-4:] == [
        ("fsdp_tp", {"batch": 4, "model": 2}, None),
        ("fsdp_tp", {"batch": 4, "model": 2}, "blocks"),
        ("fsdp_tp", {"batch": 2, "model": 4}, None),
        ("fsdp_tp", {"batch": 2, "model": 4}, "blocks"),
    ]
    candidate = Candidate("fsdp_tp", {"batch": 4, "model": 2}, remat="blocks")
    (result,) = kd.plan_search(
        tiny_gemma,
        topology="cpu:8",
        batch_size=8,
        sequence_length=16,
        candidates=[candidate],
    )
    assert result.status == "compiled" and result.error is None
    layout_map = result.distribution.layout_map
    assert type(layout_map).__name__ == "PresetLayoutMap" and layout_map.replicated
    # for_keras_hub's repair of the one key/value head, kept on the result.
    assert any("cannot be used" in said for said in result.warnings)


@pytest.mark.backend_neutral
def test_a_candidate_keeps_its_warnings_once_without_deprecations():
    from keras_dist.planner import search  # noqa: PLC0415

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("a library's own", DeprecationWarning, stacklevel=1)
        for _ in range(2):
            warnings.warn("replicated: 1 head", UserWarning, stacklevel=1)
    assert search._said(caught) == ["UserWarning: replicated: 1 head"]


# -- worker processes ---------------------------------------------------------------
@jax_only
def test_worker_processes_compile_a_model_function():
    results = kd.plan_search(
        tiny, topology="cpu:8", batch_size=64, processes=2, candidates=[FSDP, FSDP_TP]
    )
    assert {r.status for r in results} == {"compiled"}
    assert "2 process(es)" in str(results)
    assert all(r.plan is None for r in results)  # the plans stayed in the workers
    # The distribution is made here, on this process' devices.
    assert results.best.distribution.device_mesh.devices.size == 8


def tiny_dying_in_workers():
    """The tiny model here; in a worker process, the process dies (as one
    the system kills for its memory would)."""
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    return tiny()


@jax_only
def test_a_worker_process_that_dies_fails_its_candidates_not_the_search():
    results = kd.plan_search(
        tiny_dying_in_workers,
        topology="cpu:8",
        batch_size=64,
        processes=2,
        candidates=[FSDP, DATA_PARALLEL, FSDP_TP],
    )
    assert len(results.failed) == 3
    assert all("BrokenProcessPool" in r.error for r in results.failed)
    assert results.best is None


@jax_only
def test_a_model_object_or_a_lambda_compiles_in_this_process():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = kd.plan_search(
            lambda: tiny(),
            topology="cpu:8",
            batch_size=64,
            processes=2,
            candidates=[FSDP],
        )
    assert "1 process(es)" in str(results)
    assert "processes=2 not used: the model function cannot be pickled" in str(results)
    model = kd.plan_search(
        tiny(), topology="cpu:8", batch_size=64, processes=2, candidates=[FSDP]
    )
    assert "a model object is compiled in this process" in " ".join(model.notes)
    assert model[0].plan is not None


# -- the command ----------------------------------------------------------------
@pytest.fixture
def command(monkeypatch, capsys):
    """`keras-dist plan ARGS` in this process: (exit status, stdout, stderr)."""
    monkeypatch.chdir(ROOT)  # MODULE:FUNCTION imports from here, as in a shell

    def run(*arguments: str, model: str = "tests.test_plan_search:tiny"):
        try:
            status = cli.main(["plan", model, *arguments])
        except SystemExit as exit_:
            status = exit_.code
        out, err = capsys.readouterr()
        return status, out, err

    return run


@jax_only
def test_keras_dist_plan_search_prints_the_ranked_table(command):
    search = ["--search", "--topology", "cpu:8", "--batch-size", "64"]
    status, out, _ = command(*search, "--time-budget", "0.001")
    assert status == 0
    assert "Plan search: tiny on cpu:8" in out and "time budget of 0.001 s" in out
    status, out, _ = command(*search, "--time-budget", "0.001", "--json")
    assert status == 0 and json.loads(out)["results"][0]["rank"] == 1
    # Nothing fits in 10 bytes: exit status 1.
    status, out, err = command(
        *search, "--time-budget", "0.001", "--device-memory", "10"
    )
    assert status == 1 and "no candidate fits; the nearest, DataParallel" in err
    # What to try next, in flags: only more devices help state too large.
    assert "Nothing fits. The nearest: DataParallel, batch=8, remat off" in out
    assert "a --topology of more devices" in out


@jax_only
def test_keras_dist_plan_search_errors_say_the_flags(command):
    status, _, err = command("--search", "--batch-size", "64")
    assert status == 1 and "`--topology` must be a string" in err
    status, _, err = command(
        "--search", "--topology", "cpu:8", "--batch-size", "64", "--time-budget", "-1"
    )
    assert status == 1 and "`--time-budget` must be a positive number" in err
    status, _, err = command(
        "--search", "--topology", "cpu:8", "--batch-size", "64", "--mesh", "8"
    )
    assert status == 2 and "leave out --mesh" in err


# -- context parallelism (sequence_axis) ----------------------------------------------
def tiny_decoder(length: int = 64):
    """A causal attention decoder of `length` tokens (module level: picklable)."""
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(64, 32, name="embed")(tokens)
    attended = keras.layers.MultiHeadAttention(4, 8, name="attention")(
        hidden, hidden, use_causal_mask=True
    )
    model = keras.Model(tokens, keras.layers.Dense(64)(attended), name="decoder")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@jax_only
def test_sequence_axis_candidates_only_where_the_sequence_is_long_and_split():
    long_one = tiny_decoder(1024)
    # One sequence on 8 devices: each split lowers the tokens a device holds.
    assert sequence_axis_sizes(long_one, 8, batch_size=1, sequence_length=1024) == [
        2,
        4,
        8,
    ]
    # Four: beyond 2 a device holds as many tokens, with more all-gathers.
    assert sequence_axis_sizes(long_one, 8, batch_size=4, sequence_length=1024) == [2]
    # A whole sequence per device already, or a batch axis the slices need.
    assert sequence_axis_sizes(long_one, 8, batch_size=8, sequence_length=1024) == []
    assert (
        sequence_axis_sizes(
            long_one, 8, num_slices=8, batch_size=1, sequence_length=1024
        )
        == []
    )
    # Short sequences: only where the scores take an eighth of the memory.
    short = tiny_decoder(64)
    short_sizes = {"batch_size": 1, "sequence_length": 64}
    assert sequence_axis_sizes(short, 8, **short_sizes) == []
    assert sequence_axis_sizes(short, 8, **short_sizes, memory=10**9) == []
    assert sequence_axis_sizes(short, 8, **short_sizes, memory=500_000) == [2, 4, 8]
    # Sizes divide the sequence; no attention, nothing to split.
    assert sequence_axis_sizes(
        tiny_decoder(100), 8, batch_size=1, sequence_length=100, memory=1
    ) == [2, 4]
    assert sequence_axis_sizes(tiny(), 8, batch_size=1, sequence_length=2048) == []
    made = default_candidates(long_one, 8, batch_size=2, sequence_length=1024)
    assert [(c.label, c.mesh, c.remat) for c in made][-4:] == [
        ("FSDP x sequence", {"batch": 4, "seq": 2}, None),
        ("FSDP x sequence", {"batch": 4, "seq": 2}, "full"),
        ("FSDP x sequence", {"batch": 2, "seq": 4}, None),
        ("FSDP x sequence", {"batch": 2, "seq": 4}, "full"),
    ]
    assert default_candidates(long_one, 8) == default_candidates(tiny_decoder(), 8)


@jax_only
def test_sequence_axis_candidates_are_checked_and_named():
    candidate = Candidate("fsdp", {"batch": 1, "seq": 8}, remat="full")
    assert candidate.sequence_axis == "seq"
    assert candidate.description == "FSDP x sequence, batch=1 seq=8, remat full"
    assert candidate.to_dict()["sequence_axis"] == "seq"
    assert "sequence_axis" not in FSDP.to_dict()  # a plain key unchanged
    assert candidate.twin == Candidate("fsdp", {"batch": 1, "seq": 8})
    with pytest.raises(ValueError, match="'seq': s"):
        Candidate("fsdp_tp", {"batch": 1, "seq": 8})
    with pytest.raises(ValueError, match="'seq': s"):
        Candidate("fsdp", {"seq": 8, "batch": 1})


@jax_only
def test_a_long_sequence_search_compiles_sequence_axis_candidates(
    tmp_path, monkeypatch, command
):
    # One sequence on 2 devices; its attention scores are an eighth of 500 kB.
    options = {"topology": "cpu:2", "batch_size": 1, "device_memory": 500_000}
    results = kd.plan_search(
        tiny_decoder, candidates=["fsdp"], cache_dir=tmp_path, **options
    )
    statuses = {r.description: r.status for r in results}
    assert statuses["FSDP x sequence, batch=1 seq=2, remat off"] == "compiled"
    assert statuses["FSDP, batch=2, remat off"] == "compiled"
    best = results.best
    assert best.candidate.mesh == {"batch": 1, "seq": 2}
    assert best.distribution.sequence_axis == "seq"
    on_batch = next(r for r in results if r.mesh == {"batch": 2} and r.remat is None)
    assert best.peak_bytes < on_batch.peak_bytes
    assert "FSDP x sequence  batch=1 seq=2" in str(results)
    # Each its own cache entry: the second search compiles nothing.
    assert len(list(tmp_path.glob("*.json"))) == 2

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(type(get_adapter()), "compile_steps", refuse)
    again = kd.plan_search(
        tiny_decoder, candidates=["fsdp"], cache_dir=tmp_path, **options
    )
    assert {r.status for r in again if r.remat is None} == {"cached"}
    assert again.best.candidate == best.candidate
    # keras-dist plan --search: the same candidates, from the cache.
    status, out, _ = command(
        "--search",
        "--topology",
        "cpu:2",
        "--batch-size",
        "1",
        "--device-memory",
        "500000",
        "--cache-dir",
        str(tmp_path),
        model="tests.test_plan_search:tiny_decoder",
    )
    assert status == 0 and "FSDP x sequence  batch=1 seq=2" in out
    status, _, err = command(
        "--search",
        "--topology",
        "cpu:2",
        "--batch-size",
        "1",
        "--sequence-axis",
        "seq",
    )
    assert status == 2 and "leave out --sequence-axis" in err


@jax_only
def test_keras_dist_plan_takes_a_sequence_axis(command):
    status, out, _ = command(
        "--mesh",
        "1,8",
        "--axes",
        "batch,seq",
        "--sequence-axis",
        "seq",
        "--fsdp",
        "--min-size",
        "16",
        "--batch-size",
        "1",
        "--json",
        model="tests.test_plan_search:tiny_decoder",
    )
    assert status == 0
    planned = json.loads(out)
    assert "sequence_axis='seq'" in planned["distribution"]
    rows = {row["path"]: row for row in planned["variables"]}
    embeddings = rows["embed/embeddings"]
    assert "seq" in embeddings["axes"]
    assert embeddings["bytes_per_device"] * 8 == embeddings["total_bytes"]


# -- TPU topologies (libtpu) ---------------------------------------------------------
@jax_only
@pytest.mark.skipif(
    not _has_libtpu(), reason="needs libtpu (tests/run_tpu_topology.sh)"
)
def test_tpu_search_ranks_by_projected_step_time_and_keeps_xla_refusals():
    results = kd.plan_search(
        tiny,
        topology="v5e:2x2",
        batch_size=256,
        candidates=[
            Candidate("data_parallel", {"batch": 4}),
            Candidate("fsdp", {"batch": 4}),
        ],
    )
    assert all(r.fits is True and r.step_seconds > 0 for r in results)
    assert results[0].step_seconds <= results[1].step_seconds
    assert "ms" in str(results) and "ranked by peak bytes" not in str(results)
    # A batch whose activations exceed the chip's 16 GiB: XLA refuses it.
    refused = kd.plan_search(
        tiny,
        topology="v5e:2x2",
        batch_size=2**26,
        candidates=[Candidate("data_parallel", {"batch": 4})],
    )[0]
    assert refused.status == "compiled" and refused.fits is False
    assert refused.rank == 1 and refused.peak_bytes is None
    assert "RESOURCE_EXHAUSTED" in refused.compiled.steps["train"].error
