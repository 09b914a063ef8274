"""What the fine-tuning page's blocks take as given: the functions of
`examples/fine_tune_llm.py` (`build_causal_lm`, `synthetic_tokens`,
`prompts`, `fsdp_tp`), the ones the page shows.

A code block marked `<!-- run-with: snippets/fine_tuning.py -->` runs after
this file, in the same script (`tests/test_docs_code_blocks.py`), on JAX with 8
simulated devices. The example is loaded from the repository by its path (the
blocks run from an empty directory).
"""

import importlib.util
import pathlib
import warnings

import keras_dist as kd

warnings.filterwarnings("ignore", module="keras_hub")  # KerasHub's own notices

_path = pathlib.Path(kd.__file__).resolve().parents[1] / "examples/fine_tune_llm.py"
_spec = importlib.util.spec_from_file_location("fine_tune_llm", _path)
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
build_causal_lm = _example.build_causal_lm
synthetic_tokens = _example.synthetic_tokens
prompts = _example.prompts
fsdp_tp = _example.fsdp_tp
