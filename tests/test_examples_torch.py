"""The PyTorch examples, run the way docs/data-parallel.md and their docstrings
say: `keras-dist launch --nproc-per-node 2 examples/...`, word for word."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from tests.doc_commands import documented_command, run_documented

pytestmark = pytest.mark.backend("torch")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "torch_ddp_convnet.py"
FINAL_LINE = re.compile(
    r"^\[rank (\d)\] process (\d): final test accuracy ([0-9.]+), "
    r"weight checksum (.+)$"
)


def _launch(command: str, directory: pathlib.Path) -> subprocess.CompletedProcess:
    """`command`, as docs/data-parallel.md writes it (`tests/doc_commands.py`):
    4 epochs, the examples' default."""
    return run_documented(command, directory=directory, timeout=240)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> subprocess.CompletedProcess:
    return _launch(
        documented_command(
            "keras-dist launch --nproc-per-node 2 examples/torch_ddp_convnet.py"
        ),
        tmp_path_factory.mktemp("ddp"),
    )


def _final_lines(stdout: str) -> dict[int, tuple[float, str]]:
    found = {}
    for line in stdout.splitlines():
        match = FINAL_LINE.match(line)
        if match:
            launcher_rank, process, accuracy, checksum = match.groups()
            assert launcher_rank == process
            found[int(process)] = (float(accuracy), checksum)
    return found


def test_example_trains_and_every_rank_ends_with_the_same_weights(launched):
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    final = _final_lines(launched.stdout)
    assert sorted(final) == [0, 1], launched.stdout
    (accuracy_0, checksum_0), (accuracy_1, checksum_1) = final[0], final[1]
    # 4 epochs reach about 0.95-0.98 on the held-out digits; 0.9 leaves room
    # for other seeds and torch versions while still catching broken training.
    assert accuracy_0 > 0.9, launched.stdout
    # The evaluation's metrics are global, so both ranks report the same value.
    assert accuracy_0 == accuracy_1
    assert checksum_0 == checksum_1


def test_only_rank_zero_reports_progress(launched):
    assert launched.returncode == 0, launched.stderr[-3000:]
    lines = launched.stdout.splitlines()
    rank_0 = [line for line in lines if line.startswith("[rank 0] ")]
    rank_1 = [line for line in lines if line.startswith("[rank 1] ")]
    assert any("Epoch 4/4" in line for line in rank_0), launched.stdout
    assert sum("val_accuracy" in line for line in rank_0) == 4, launched.stdout
    # Rank 1 prints only its final line.
    assert len(rank_1) == 1 and FINAL_LINE.match(rank_1[0]), launched.stdout
    progress = re.compile(r"Epoch \d|\d+/\d+ - |loss:")
    assert not any(progress.search(line) for line in rank_1)
    rank_1_errors = [
        line for line in launched.stderr.splitlines() if line.startswith("[rank 1] ")
    ]
    assert not any(progress.search(line) for line in rank_1_errors)


def test_model_parallel_example_shards_and_every_rank_ends_with_the_same_weights(
    tmp_path,
):
    """`examples/torch_model_parallel.py` under `keras-dist launch`, 2 processes."""
    launched = _launch(
        documented_command(
            "keras-dist launch --nproc-per-node 2 examples/torch_model_parallel.py"
        ),
        tmp_path,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    final = _final_lines(launched.stdout)
    assert sorted(final) == [0, 1], launched.stdout
    # 4 epochs reach about 0.95 on the held-out digits.
    assert final[0][0] > 0.9 and final[0] == final[1], launched.stdout
    for rank in (0, 1):
        (held,) = [
            line
            for line in launched.stdout.splitlines()
            if line.startswith(f"[rank {rank}] process {rank}: held while training")
        ]
        # Half of the 512 columns of the first kernel and of the 512 rows of the
        # second; the logits layer is not in the LayoutMap: whole.
        assert "digits_mlp/wide_in/kernel (64, 256)" in held
        assert "digits_mlp/wide_out/kernel (256, 64)" in held
        assert "digits_mlp/logits/kernel (64, 10)" in held
