"""One process of a multi-process job training the user's own steps.

Usage: python custom_steps_worker.py SCENARIO[,SCENARIO...] OUTPUT_JSON

For each scenario: plain Keras on this process alone, then keras_dist over
every process; both results are written for the test to compare.
"""

from __future__ import annotations

import json
import pathlib
import sys
import warnings

import keras_dist as kd

kd.initialize()

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import custom_step_models  # noqa: E402

results = {}
for name in sys.argv[1].split(","):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = custom_step_models.train(name)
        ours = custom_step_models.train(name, kd.DataParallel())
    results[name] = {
        "plain": plain,
        "ours": ours,
        "warnings": [str(w.message) for w in caught if "keras_dist" in str(w.message)],
    }
pathlib.Path(sys.argv[2]).write_text(json.dumps(results))
