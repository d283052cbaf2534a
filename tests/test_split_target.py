"""A target split over two ranks on this machine (`mlx.launch -n 2 --backend ring`, loopback) with
mlx-lm's own methods, tensor parallel (`shard`) and pipeline parallel (`pipeline`): speculative greedy
output equals the split target's own plain decoding and one process's, and a seeded sampled run equals
the same run on one machine, for a dense llama and a qwen3_5 hybrid in each mode its class has; targets
that cannot be split are one error line on every rank; the server on a split target answers as one process
and its shutdown ends the follower."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.loading.load import load
from mlx_dspark.models.distributed.split_target import SplitTargetError, lead
from mlx_dspark.testing.mlx_lm_checkpoints import write_draft_for, write_tiny_mlx_lm_target

LAUNCH = Path(sys.executable).with_name("mlx.launch")
_LAUNCHES = itertools.count()


def launch_command(ranks: int, python: str) -> list[str]:
    """mlx.launch on loopback, on ports of this test worker's own: two jobs on one host (xdist workers, CI
    beside a session) on mlx.launch's default ports connect across jobs."""
    launcher = str(LAUNCH) if LAUNCH.is_file() else shutil.which("mlx.launch")
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    port = 21000 + 1000 * worker + 16 * (next(_LAUNCHES) % 60)  # below the ephemeral range (32768..)
    return [launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(port), "--python", python]
REPO = Path(__file__).resolve().parents[1]  # the ranks import this checkout's package, whatever is installed
pytestmark = pytest.mark.skipif(not LAUNCH.is_file() and shutil.which("mlx.launch") is None,
                                reason="mlx.launch (MLX's launcher) is not installed beside this Python")


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    target = write_tiny_mlx_lm_target(root / "target", family="llama")  # 4 heads, 2 KV heads: split in 2
    return target, write_draft_for(root / "draft", target_path=target)


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("split-hybrid")
    target = write_tiny_mlx_lm_target(root / "target", family="qwen3_5")  # 2 GatedDeltaNet + 2 attention layers
    return target, write_draft_for(root / "draft", target_path=target)


HYBRID_RUN = ["--prompt", "hello world", "--max-tokens", "32", "--json", "--max-draft-tokens", "7", "--lookup", "off"]
SAMPLED = ["--temp", "0.8", "--seed", "5"]


@pytest.fixture(scope="module")
def hybrid_one_process(hybrid_pair, tmp_path_factory):
    """The hybrid pair's greedy plain and seeded sampled outputs in one process."""
    target, draft = map(str, hybrid_pair)
    common, cwd = ["--model", target, "--draft", draft, *HYBRID_RUN], tmp_path_factory.mktemp("one-process")
    return tokens(one_process([*common, "--no-draft"], cwd)), tokens(one_process([*common, *SAMPLED], cwd))


def environment(costs: Path) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "MLX_DSPARK_COST_DIR": str(costs)}


def one_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_dspark.generate", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=environment(cwd / "c1"))  # fmt: skip


def launched(args: list[str], cwd: Path, ranks: int = 2, command: str = "mlx_dspark.generate") -> subprocess.CompletedProcess:
    env = environment(cwd / "costs")
    return subprocess.run([*launch_command(ranks, sys.executable), "--",
                           "-m", command, *args], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env=env)  # fmt: skip


def tokens(result: subprocess.CompletedProcess) -> list[int]:
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens"]


@pytest.mark.slow
def test_speculation_on_a_split_target_is_lossless(llama_pair, tmp_path):
    target, draft = map(str, llama_pair)
    common = ["--model", target, "--draft", draft, "--prompt", "hello world", "--max-tokens", "40", "--json"]
    plain = launched([*common, "--no-draft"], tmp_path)
    fixed = launched([*common, "--max-draft-tokens", "7"], tmp_path)
    default = launched(common, tmp_path)  # auto: the cost curve measured through the split target
    assert tokens(fixed) == tokens(plain) and tokens(default) == tokens(plain)
    assert "target split over 2 ranks" in fixed.stderr and "rank 1: followed" in fixed.stderr
    summary = json.loads(fixed.stdout.strip().splitlines()[-1])
    assert summary["target_forwards"] < 40 or summary["mean_acceptance_length"] >= 1  # rounds were verified
    assert any(int(n) >= 2 for n in summary["draft_lengths"])  # several tokens verified per split forward
    # fixed length, no lookup: the rounds do not depend on either machine's measured costs
    sampled = [*common, "--temp", "0.8", "--seed", "3", "--max-draft-tokens", "7", "--lookup", "off"]
    assert tokens(launched(sampled, tmp_path)) == tokens(one_process(sampled, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_a_split_hybrid_decodes_as_one_process(hybrid_pair, hybrid_one_process, tmp_path, mode):
    # qwen3_5: mlx-lm's class has both `shard` (its LM head split over the vocabulary too: the draft reads a
    # whole copy on rank 0) and `pipeline` (a tap of rank 1's layers reaches the draft on rank 0); every
    # rejected draft rolls the GatedDeltaNet states back by replaying the layer, on both ranks
    target, draft = map(str, hybrid_pair)
    flag = ["--pipeline"] if mode == "pipeline" else []
    common = ["--model", target, "--draft", draft, *HYBRID_RUN]
    plain, sampled = hybrid_one_process
    # speculative with the default auto length (the cost curve measured through the split target: its width-1
    # steps cannot be restored from a snapshot on the ranks that follow), then plain, both on the split target
    split = launched([*common, "--max-draft-tokens", "auto", "--compare", *flag], tmp_path)
    assert tokens(split) == plain and json.loads(split.stdout.strip().splitlines()[-1])["plain"]["identical"]
    assert f"target split over 2 ranks ({mode} parallel)" in split.stderr and "rank 1: followed" in split.stderr
    assert tokens(launched([*common, *SAMPLED, *flag], tmp_path)) == sampled


@pytest.mark.slow
def test_a_target_that_cannot_be_split_is_one_line(tiny_spark_pair, llama_pair, tmp_path):
    target, draft = map(str, tiny_spark_pair)  # mlx-lm's spark2_5 has no `shard`
    result = launched(["--model", target, "--draft", draft, "--prompt", "hi", "--max-tokens", "4"], tmp_path)
    assert "Traceback" not in result.stderr and "exited with code 2" in result.stderr  # mlx.launch itself exits 0
    assert "error: rank 0: the target (" in result.stderr and "cannot be split over 2 ranks" in result.stderr
    target, draft = map(str, llama_pair)
    result = launched(["--model", target, "--draft", draft, "--prompt", "hi", "--max-tokens", "4"], tmp_path, ranks=3)
    assert "Traceback" not in result.stderr and "exited with code 2" in result.stderr
    assert "not divisible by the 3 ranks" in result.stderr
    result = launched(["--model", target, "--draft", draft, "--prompt", "hi", "--max-tokens", "4", "--pipeline"], tmp_path)
    assert "Traceback" not in result.stderr and "exited with code 2" in result.stderr  # mlx-lm's llama has no `pipeline`
    assert "cannot be split pipeline-parallel over 2 ranks: mlx-lm's class implements tensor-parallel only" in result.stderr


@pytest.mark.slow
def test_calibrate_measures_the_split_targets_costs(llama_pair, tmp_path):
    target, draft = map(str, llama_pair)
    result = launched(["--model", target, "--draft", draft], tmp_path, command="mlx_dspark.calibrate")
    assert "Traceback" not in result.stderr and re.search(r"verify of 1\.\.(8|33) tokens", result.stdout), result.stderr[-2000:]
    assert "rank 1: followed" in result.stderr  # every measured forward ran on both ranks


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of `rank` among the launcher's descendants (its MLX_RANK), from /proc."""
    pending, seen = [launcher_pid], set()
    while pending:
        pid = pending.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # a thread or process that ended while we looked (a loaded machine: mlx.launch's helpers)
                continue
            for child in children:
                if int(child) not in seen:
                    seen.add(int(child))
                    pending.append(int(child))
    for pid in seen:
        try:
            if f"MLX_RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks' processes through Linux's /proc")
@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL], ids=["hung", "killed"])
def test_a_rank_lost_mid_generation_ends_the_job_in_one_line(llama_pair, tmp_path, how):
    # killed: its sockets close and MLX's ring fails the collective; hung (stopped, as a Mac that loses
    # power or its cable): nothing closes, the others' heartbeats stop hearing it
    target, draft = map(str, llama_pair)
    args = ["--model", target, "--draft", draft, "--prompt", "hello", "--max-tokens", "2000", "--max-draft-tokens", "3"]
    job = subprocess.Popen([*launch_command(2, sys.executable), "--", "-m",
                            "mlx_dspark.generate", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           cwd=tmp_path, env=environment(tmp_path / "costs"))  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(job.stderr.readline, "")), daemon=True)
    reader.start()
    follower = None
    try:
        deadline = time.monotonic() + 90
        while not any("target split over 2 ranks" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # mid-generation
        follower = _rank_pid(job.pid, 1)
        assert follower is not None and job.poll() is None, "".join(lines)
        os.kill(follower, how)
        lost_at = time.monotonic()
        while not any("error: rank 0:" in line for line in lines) and time.monotonic() < lost_at + 20:
            time.sleep(0.1)
        waited = time.monotonic() - lost_at
        # mlx.launch relays the ranks' stderr beside its own coloured "[WARN] ..." lines: ours may land inside one
        errors = [line[line.index("error: rank"):] for line in lines if "error: rank" in line]
        assert errors and waited < 10, f"{waited:.1f} s: " + "".join(lines[-20:])
        text = "".join(lines)
        # known, left for later: CPython's own "Exception ignored when trying to write to the signal wakeup fd"
        # report, now and then, from a rank killed by mlx.launch while it ends (after its one error line)
        assert len(errors) == 1 and ("Traceback" not in text or "signal wakeup fd" in text), text[-3000:]
        if how == signal.SIGSTOP:
            assert "rank 1 has not answered" in errors[0]
        else:  # whichever comes first: the ring's failed collective, mlx.launch stopping rank 0, or (a loaded
            # machine, where the collective had not started yet) the heartbeat's silence
            assert any(why in errors[0] for why in ("link to another rank was lost", "mlx.launch stopped this rank",
                                                     "rank 1 has not answered")), errors[0]
    finally:
        if follower is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGKILL)
        job.kill() if job.poll() is None and job.wait(timeout=15) is None else None


@pytest.mark.slow
def test_ranks_that_loaded_different_files_are_one_line(llama_pair, tmp_path):
    # the same relative paths resolve to other files on rank 1 (as two Macs with other copies would):
    # a python wrapper starts each rank in its own directory
    target, draft = llama_pair
    for rank, seed in ((0, 0), (1, 1)):
        (tmp_path / f"rank{rank}").mkdir()
        write_tiny_mlx_lm_target(tmp_path / f"rank{rank}" / "target", family="llama", seed=seed)  # same shapes
        shutil.copytree(draft, tmp_path / f"rank{rank}" / "draft")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\ncd "{tmp_path}/rank$MLX_RANK" && exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    result = subprocess.run([*launch_command(2, str(wrapper)), "--", "-m", "mlx_dspark.generate",
                             "--model", "target", "--draft", "draft", "--prompt", "hi", "--max-tokens", "4"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=environment(tmp_path / "costs"))  # fmt: skip
    assert "Traceback" not in result.stderr and "exited with code 2" in result.stderr, result.stderr[-2000:]
    assert "error: rank 0: the ranks did not load the same target (versions, config, weights): differ from this rank's (rank 1: weights)" in result.stderr


def _chat(port: int, body: dict) -> Any:
    """One chat completion on a fresh connection: the parsed answer, or the stream's text joined."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    if not body.get("stream"):
        return json.loads(response.read())
    text = ""
    for line in response:
        data = line.decode().strip().removeprefix("data: ")
        if data == "[DONE]":
            break
        if data:
            text += json.loads(data)["choices"][0]["delta"].get("content") or ""
    conn.close()
    return text


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks' processes through Linux's /proc")
def test_the_server_on_a_split_target_answers_as_one_process_and_stops_its_followers(llama_pair, tmp_path):
    from mlx_dspark.api import generate
    from mlx_dspark.loading.load import load

    target, draft = map(str, llama_pair)
    with socket.socket() as probe:  # a free port for rank 0 (the other ranks bind none)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = subprocess.Popen([*launch_command(2, sys.executable), "--", "-m", "mlx_dspark.server", "--model", target,
                            "--draft", draft, "--port", str(port), "--max-draft-tokens", "7"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env=environment(tmp_path / "costs"))  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(job.stderr.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while not any("ready (speculative decoding)" in line for line in lines) and time.monotonic() < deadline:
            assert job.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert any("one request at a time" in line for line in lines), "".join(lines)
        messages = [{"role": "user", "content": "Say something."}]
        want = generate(load(target, draft=draft), messages, max_tokens=24)  # one process, plain greedy decoding
        answer = _chat(port, {"messages": messages, "max_tokens": 24})
        assert answer["choices"][0]["message"]["content"] == want.text and answer["dspark"]["speculative"]
        assert _chat(port, {"messages": messages, "max_tokens": 24, "stream": True}) == want.text
        rank0 = _rank_pid(job.pid, 0)
        assert rank0 is not None, "".join(lines)
        os.kill(rank0, signal.SIGTERM)  # the server's shutdown: rank 0 releases the follower, both exit 0
        assert job.wait(timeout=60) == 0
        time.sleep(0.5)  # the reader's last lines
        text = "".join(lines)
        assert "shutting down" in text and "rank 1: followed" in text, text[-3000:]
        assert "Traceback" not in text and "error:" not in text and "exited with code" not in text, text[-3000:]
        assert sum("listening on" in line for line in lines) == 1  # rank 0 alone binds
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=15)


def test_the_split_hook_runs_on_the_lazy_target_before_its_weights_are_read(llama_pair, monkeypatch):
    """mlx.launch entry points split the target inside `load`, before its parameters are evaluated and
    before the load's probe forward: a rank reads and holds its own slice only (mlx-lm's sharded_load)."""
    import mlx_dspark
    from mlx_dspark.cli.split import target_splitter
    from mlx_dspark.loading import load as load_module

    events = []
    real_probe = load_module.probe_target
    monkeypatch.setattr(load_module, "probe_target", lambda model: (events.append("probe"), real_probe(model)))
    monkeypatch.setattr(load_module.mx, "eval", _recording_eval(load_module.mx.eval, events))
    target, draft = map(str, llama_pair)
    pair = mlx_dspark.load(target, draft=draft, split=lambda model, path: events.append(("split", Path(path).name)))
    assert events.index(("split", Path(target).name)) < events.index("probe")
    assert "eval target" not in events[: events.index(("split", Path(target).name))]
    assert pair.target is not None and target_splitter(None) is None  # a plain run passes no hook


def _recording_eval(real_eval, events):
    def recorded(*args):
        if any(isinstance(a, dict) and "model" in a for a in args):  # the target's parameter tree
            events.append("eval target")
        return real_eval(*args)

    return recorded


def test_a_split_targets_rank_0_refuses_a_batched_forward_before_announcing_it(llama_pair):
    # the followers run each announced forward as (1, width): rank 0's words all_sum of a (2, width) batch
    # would be twice the size the followers sum, and the ranks' collectives would go out of step
    target = lead(load(str(llama_pair[0])).target, mx.distributed.init())
    cache = target.make_cache()
    with pytest.raises(SplitTargetError, match=r"one sequence per forward .*not \(2, 3\)"):
        target(mx.zeros((2, 3), dtype=mx.int32), cache=cache)
    assert target._split_count == 0  # nothing was announced
