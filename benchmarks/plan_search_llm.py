"""`kd.plan_search` for KerasHub decoders of about 2B and 7B parameters on
TPU pods this machine does not have: every candidate distribution (data
parallel, FSDP, FSDP x tensor parallel; remat off and on) compiled for the
topology on abstract values, ranked, with each compile's time.

The models are made from configurations (random weights, nothing is
downloaded or allocated): a Gemma-2B-like `GemmaBackbone` and a
Llama-2-7B-like `LlamaBackbone`, each in its `CausalLM` with AdamW and a
sparse cross-entropy, computing in bfloat16 with float32 variables.

    # needs libtpu (pip install "keras-dist[tpu]"); CPU only is fine
    KERAS_BACKEND=jax python benchmarks/plan_search_llm.py --model gemma_2b \\
        --topology v5e-256 --batch-size 256 --sequence-length 2048
    KERAS_BACKEND=jax python benchmarks/plan_search_llm.py --model llama2_7b \\
        --topology v5p-128 --time-budget 3600 --cache-dir /tmp/plans
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GEMMA_2B = {
    "vocabulary_size": 256000,
    "num_layers": 18,
    "num_query_heads": 8,
    "num_key_value_heads": 1,
    "hidden_dim": 2048,
    "intermediate_dim": 32768,
    "head_dim": 256,
}
LLAMA2_7B = {
    "vocabulary_size": 32000,
    "num_layers": 32,
    "num_query_heads": 32,
    "num_key_value_heads": 32,
    "hidden_dim": 4096,
    "intermediate_dim": 11008,
}
DTYPE = "mixed_bfloat16"


def _compiled(causal_lm):
    import keras  # noqa: PLC0415

    causal_lm.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return causal_lm


def gemma_2b():
    """A Gemma-2B-like causal LM (module level: worker processes unpickle it)."""
    import keras_hub  # noqa: PLC0415

    backbone = keras_hub.models.GemmaBackbone(**GEMMA_2B, dtype=DTYPE)
    return _compiled(
        keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    )


def llama2_7b():
    """A Llama-2-7B-like causal LM."""
    import keras_hub  # noqa: PLC0415

    backbone = keras_hub.models.LlamaBackbone(**LLAMA2_7B, dtype=DTYPE)
    return _compiled(
        keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    )


MODELS = {"gemma_2b": gemma_2b, "llama2_7b": llama2_7b}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma_2b")
    parser.add_argument("--topology", default="v5e-256")
    parser.add_argument("--num-slices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--time-budget", type=float, default=None)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument(
        "--candidates",
        default=None,
        help="policies to keep, e.g. fsdp,fsdp_tp (default: all)",
    )
    parser.add_argument("--json", metavar="PATH", help="append the results there")
    arguments = parser.parse_args()

    import keras_dist as kd  # noqa: PLC0415  (after parsing: imports the backend)

    started = time.perf_counter()
    with warnings.catch_warnings():
        # for_keras_hub's repairs (one key/value head) are kept per candidate.
        warnings.simplefilter("ignore")
        results = kd.plan_search(
            MODELS[arguments.model],
            topology=arguments.topology,
            num_slices=arguments.num_slices,
            batch_size=arguments.batch_size,
            sequence_length=arguments.sequence_length,
            time_budget=arguments.time_budget,
            processes=arguments.processes,
            cache_dir=arguments.cache_dir,
            candidates=arguments.candidates.split(",")
            if arguments.candidates
            else None,
        )
    print(results)
    print(f"wall time: {time.perf_counter() - started:.0f} s")
    for result in results:
        print(f"  {result.description}: {result.status}, {result.seconds:.0f} s")
    if arguments.json:
        record = {
            "model": arguments.model,
            "topology": arguments.topology,
            "batch_size": arguments.batch_size,
            "sequence_length": arguments.sequence_length,
            "wall_seconds": time.perf_counter() - started,
            **results.to_dict(),
        }
        with open(arguments.json, "a") as file:
            file.write(json.dumps(record) + "\n")
    return 0 if results.best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
