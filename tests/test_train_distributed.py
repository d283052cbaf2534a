"""Data-parallel training (mlx_dspark.train under `mlx.launch`): 2 local ranks over the ring backend on
loopback compute the single-process steps, and a checkpoint of the 2-rank run resumes on 1 process."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.train.distributed import World

TEXT = (
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n"
    "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10.\n"
)
TIMEOUT = 180  # seconds for one command; a hung ring connection fails the test instead of the session


def test_shares_cover_the_global_batch_in_order():
    for count, size in ((4, 2), (5, 2), (7, 3), (3, 3)):
        shares = [World(None, rank=r, size=size).share(count) for r in range(size)]
        assert [i for s in shares for i in range(count)[s]] == list(range(count))
        assert max(s.stop - s.start for s in shares) - min(s.stop - s.start for s in shares) <= 1
    with pytest.raises(ValueError, match="--batch-size >= 4"):
        World(None, rank=0, size=4).share(3)


def free_port() -> int:
    # the ring backend listens on port and port + 1 for two ranks on one address
    for _ in range(20):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port > 60000:
            continue
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.skip("no two consecutive free ports on loopback")


def launcher() -> list[str]:
    """`mlx.launch` beside this interpreter (the console script), else its module."""
    script = Path(sys.executable).with_name("mlx.launch")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def _launch_available() -> bool:
    return mx.distributed.is_available("ring")


def _train(args: list[str], *, ranks: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mlx_dspark.train", *args]
    if ranks > 1:
        command = [*launcher(), "-n", str(ranks), "--backend", "ring", "--hosts", "127.0.0.1", "-p", str(free_port()), "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(out: Path) -> list[float]:
    summary = json.loads((out / "training.json").read_text(encoding="utf-8"))
    return [entry["loss"] for entry in summary["history"]], summary


@pytest.mark.slow
@pytest.mark.skipif(not _launch_available(), reason="this MLX build has no ring backend")
def test_two_ring_ranks_get_the_single_process_losses_and_resume_on_one(tiny_qwen3_target, tmp_path):
    data = tmp_path / "train"
    data.mkdir()
    for i in range(4):
        (data / f"doc{i}.txt").write_text(TEXT * (2 + i), encoding="utf-8")
    common = [
        "--target", str(tiny_qwen3_target), "--data", str(data), "--steps", "4", "--batch-size", "5",
        "--seq-len", "48", "--anchors", "8", "--lr", "3e-3", "--layers", "2", "--num-taps", "2",
        "--sliding-window", "16", "--markov-rank", "16", "--no-progress", "--log-every", "1",
    ]  # fmt: skip  (a global batch of 5: the ranks get 3 and 2 sequences)
    one, two = tmp_path / "one", tmp_path / "two"
    single = _train([*common, "--out", str(one)], ranks=1)
    assert single.stderr.count("tok/s") == 4  # a plain line every step without the progress bar
    parallel = _train([*common, "--out", str(two), "--checkpoint-every", "2"], ranks=2)
    assert parallel.stderr.count("tok/s") == 4  # rank 0 alone logs
    reference, summary_one = _losses(one)
    losses, summary_two = _losses(two)
    assert (summary_one["world_size"], summary_two["world_size"]) == (1, 2)
    assert [e["step"] for e in summary_two["history"]] == [1, 2, 3, 4]
    assert len(set(reference)) == 4  # the losses move: equal lists would say little
    np.testing.assert_allclose(losses, reference, rtol=1e-3)
    a, b = mx.load(str(one / "model.safetensors")), mx.load(str(two / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(np.array(b[name]), np.array(a[name]), rtol=1e-3, atol=1e-5, err_msg=name)

    # the 2-rank run's checkpoint of step 2, continued on one process: the same steps 3 and 4
    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoints", resumed / "checkpoints")
    assert [p.name for p in sorted((resumed / "checkpoints").iterdir())] == ["step-000002"]
    result = _train([*common, "--out", str(resumed), "--resume"], ranks=1)
    assert "resuming at step 2" in result.stderr
    losses, summary = _losses(resumed)
    assert summary["resumed_from_step"] == 2 and [e["step"] for e in summary["history"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(losses, reference, rtol=1e-3)
