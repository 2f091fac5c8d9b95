"""Multi-process training on jax.distributed: real processes on 127.0.0.1, every run time-bounded.

The equivalence runs train the tiny GPT of `_dist_driver` for 3 steps as 2 processes × 4 CPU
devices (through ``meshtrain launch``) and as 1 process × 8 devices on the same mesh shape, on
a corpus prepared here (the ``tokens`` source, packed documents), and compare losses, the first
global batch and the final parameters. Both sides compile with the
same cheap XLA CPU flags (compile time dominates these runs).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _helpers import TINY_JOB, load_benchmark

from meshtrain.cli.launch import parse as parse_launch
from meshtrain.data import DataConfig, make_dataset, prepare_corpus
from meshtrain.distributed import DistributedConfig
from meshtrain.launch import plan as plan_launch
from meshtrain.layout import process_rows, rules_for
from meshtrain.mesh import host_layout, make_mesh

ROOT = Path(__file__).resolve().parents[1]
soak = load_benchmark("soak")  # its child environment
DRIVER = ROOT / "tests" / "_dist_driver.py"
RUN_TIMEOUT = 420  # hard bound on any one multi-process run, in seconds
# float32, 3 AdamW steps; only the order of cross-device sums differs (measured: losses
# ≤ 4.8e-7 apart, parameters ≤ 1.2e-7).
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6
TINY_TRAIN = [*TINY_JOB, "--no-save"]


def _env(**extra: str) -> dict[str, str]:
    """The soak's child environment (no MESHTRAIN_* variables, cheap compiles: this process's
    flags, `FAST_COMPILE` among them), unbuffered, plus `extra`."""
    return soak.env(**{"PYTHONUNBUFFERED": "1", **extra})


def _meshtrain(*args: str, timeout: float = RUN_TIMEOUT, **env: str):
    """Runs ``python -m meshtrain.cli ARGS``; returns the CompletedProcess (output merged)."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", *args],
        env=_env(**env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def _wait(proc: subprocess.Popen, what: str, timeout: float = RUN_TIMEOUT) -> str:
    """Waits for `proc` (killing it past `timeout`); returns its output, failing on rc ≠ 0."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} ran past {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def _assemble(out_dir: Path, layout: str, nproc: int) -> dict:
    """Reassembles the shards the processes of one run wrote; checks every element once."""
    parts = [dict(np.load(out_dir / f"{layout}.p{i}.npz")) for i in range(nproc)]
    for p in parts[1:]:
        np.testing.assert_array_equal(p["losses"], parts[0]["losses"])
    shards: dict[str, list] = {}
    for p in parts:
        for key, shard in p.items():
            if "@" in key:
                name, where = key.split("@")
                bounds = [tuple(map(int, b.split(":"))) for b in where.split(",")]
                shards.setdefault(name, []).append((bounds, shard))
    full = {}
    for name, pieces in shards.items():
        shape = np.max([[hi for _, hi in bounds] for bounds, _ in pieces], axis=0)
        array, count = np.zeros(shape, pieces[0][1].dtype), np.zeros(shape, int)
        for bounds, shard in pieces:
            index = tuple(slice(lo, hi) for lo, hi in bounds)
            array[index], count[index] = shard, count[index] + 1
        assert (count == 1).all(), f"{layout}: the shards of {name} cover some elements ≠ once"
        full[name] = array
    return {"losses": parts[0]["losses"], "rows": [p["rows"] for p in parts], "arrays": full}


def _corpus(base: Path) -> str:
    """A prepared byte-level corpus of fresh documents of 1 to 12 bytes (several to a row).

    Three-quarters "a", a quarter "b": every batch pulls the same two logits up, so 3 AdamW
    steps lower the loss whatever the batches hold (uniform letters did not, now and then).
    """
    rng = np.random.default_rng()
    letters = np.frombuffer(b"ab", np.uint8)
    with open(base / "docs.jsonl", "w") as f:
        for n in rng.integers(1, 13, size=120):
            text = rng.choice(letters, n, p=[0.75, 0.25]).tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
    out = base / "corpus"
    prepare_corpus([str(base / "docs.jsonl")], str(out), progress=False, workers=1)
    return str(out)


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory):
    """2 × 4 devices (meshtrain launch) and 1 × 8 devices, all layouts, run concurrently."""
    base = tmp_path_factory.mktemp("dist")
    layouts = ["--tokens", _corpus(base), "dp", "fsdp", "tp", "pipe", "federated"]
    multi = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", "2",
         "--devices-per-proc", "4", "--", sys.executable, str(DRIVER), str(base / "multi"),
         *layouts],
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    single = subprocess.Popen(
        [sys.executable, str(DRIVER), str(base / "single"), *layouts],
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out = _wait(multi, "meshtrain launch (2 × 4 devices)")
    _wait(single, "single-process reference (1 × 8 devices)")
    return base, out


@pytest.mark.slow
def test_two_processes_match_one(equivalence_runs):
    """DP, FSDP, TP, 1F1B with pipe across the processes, and federated rounds (the clients
    each round samples, the same on every process); one test, so one pair of runs."""
    base, out = equivalence_runs
    for layout in ("dp", "fsdp", "tp", "pipe", "federated"):
        _check_layout(base, out, layout)


def _check_layout(base: Path, out: str, layout: str) -> None:
    """Losses, first global batch, final parameters and per-process rows of one layout."""
    multi = _assemble(base / "multi", layout, 2)
    single = _assemble(base / "single", layout, 1)
    np.testing.assert_allclose(
        multi["losses"], single["losses"], rtol=LOSS_RTOL, err_msg=f"{layout} losses"
    )
    assert len(multi["losses"]) == 3 and multi["losses"][-1] < multi["losses"][0], layout
    # the global batch that step 1 trained on is the single-process one, row for row
    keys = ["inputs", "targets"] + ([] if layout == "pipe" else ["segment_ids", "positions"])
    assert sorted(k for k in multi["arrays"] if k.startswith("batch/")) == sorted(
        f"batch/{k}" for k in keys
    ), layout  # packed (the tokens source) except under pipe, which takes plain windows
    for key in keys:
        np.testing.assert_array_equal(
            multi["arrays"][f"batch/{key}"], single["arrays"][f"batch/{key}"], err_msg=layout
        )
    if layout != "pipe":  # rows hold several documents, so the masks matter
        assert (multi["arrays"]["batch/segment_ids"].max(axis=1) > 1).all(), layout
    params = sorted(k for k in single["arrays"] if k.startswith("param/"))
    assert params and sorted(k for k in multi["arrays"] if k.startswith("param/")) == params
    for name in params:
        np.testing.assert_allclose(
            multi["arrays"][name],
            single["arrays"][name],
            atol=PARAM_ATOL,
            err_msg=f"{layout} {name}",
        )
    # each process read only the rows its devices hold: halves for data across processes,
    # the whole batch for pipe across processes (both stages see every row)
    rows = [tuple(r) for r in multi["rows"]]
    assert rows == ([(0, 8), (0, 8)] if layout == "pipe" else [(0, 4), (4, 8)]), (layout, rows)
    assert f"[p1] layout {layout}: losses" in out
    worst = max(np.abs(multi["arrays"][n] - single["arrays"][n]).max() for n in params)
    print(f"{layout}: max |Δloss| {np.abs(multi['losses'] - single['losses']).max():.1e}, "
          f"max |Δparam| {worst:.1e}")  # fmt: skip


def _start(rank: int, nproc: int, port: int, args: list[str], log: Path, **env: str):
    """Starts process `rank` of a `meshtrain train` job by hand (no launcher)."""
    extra = dict(
        MESHTRAIN_COORDINATOR=f"127.0.0.1:{port}",
        MESHTRAIN_NUM_PROCESSES=str(nproc),
        MESHTRAIN_PROCESS_ID=str(rank),
        **env,
    )
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "meshtrain.cli", "train", "--devices", "2", *args],
            env=_env(**extra),
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the survivor's log says when the other process is lost, by which one was killed.
LOST_MESSAGE = {
    1: "The following tasks are unhealthy (stopped sending heartbeats):\n1\n",
    0: "Either the leader task was preempted/died/restarted unexpectedly",
}


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "coordinator"])
def test_killed_process_stops_the_survivor(tmp_path, victim):
    """SIGKILL one process mid-run: the other exits non-zero within the bound, saying which."""
    heartbeat, bound = 5, 20  # seconds; the default heartbeat is 30
    survivor = 1 - victim
    port, run_dir = _free_port(), tmp_path / "run"
    args = [*TINY_TRAIN, "--mesh", "data=4", "--strategy", "dp", "--steps", "100000",
            "--log-every", "1", "--eval-every", "0", "--run-dir", str(run_dir)]  # fmt: skip
    procs = [
        _start(r, 2, port, args, tmp_path / f"p{r}.log", MESHTRAIN_HEARTBEAT_TIMEOUT=str(heartbeat))
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = procs[survivor].wait(timeout=bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {survivor} still running {bound} s after {victim} was killed")
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    log = (tmp_path / f"p{survivor}.log").read_text()
    assert code != 0, log[-3000:]
    assert LOST_MESSAGE[victim] in log, log[-3000:]
    print(f"process {victim} killed: {survivor} exited with {code} after {took:.1f} s")


@pytest.mark.slow
def test_mismatched_process_counts_fail_on_every_process(tmp_path):
    port = _free_port()
    procs = [
        _start(0, 2, port, TINY_TRAIN, tmp_path / "p0.log"),
        _start(1, 3, port, TINY_TRAIN, tmp_path / "p1.log"),
    ]
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for rank, code in enumerate(codes):
        log = (tmp_path / f"p{rank}.log").read_text()
        assert code == 2, log[-3000:]
        assert "meshtrain train: error: mismatched process counts: 2 processes joined" in log, log
        assert "process 1 was told 3" in log and "MESHTRAIN_NUM_PROCESSES" in log
        assert "Traceback" not in log


@pytest.mark.slow
def test_mesh_that_cannot_span_processes_is_a_clear_error():
    """fsdp=8 would put an inner axis across 2 processes: refused by the launcher, before any
    process starts."""
    done = _meshtrain(
        "launch", "--nproc", "2", "--devices-per-proc", "4", "--", "train", "--mesh", "fsdp=8",
        "--strategy", "fsdp", *TINY_TRAIN,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:]
    assert (
        "meshtrain launch: error: train mesh fsdp=8 cannot be laid out on 2 processes × 4 "
        "devices: the axes across processes are pipe and data (pipe × data = 1)" in done.stdout
    ), done.stdout[-3000:]
    assert "[launch]" not in done.stdout
    assert "Traceback" not in done.stdout


def test_coordinator_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launched = _meshtrain("launch", "--nproc", "2", "--port", str(port), "--", "train")
        assert launched.returncode == 2
        assert f"launch --port {port}: the port is already in use" in launched.stdout
        direct = _meshtrain(
            "train", "--devices", "1", "--dist.coordinator", f"127.0.0.1:{port}",
            "--dist.num-processes", "1", "--dist.process-id", "0", *TINY_TRAIN, timeout=120,
        )  # fmt: skip
    assert direct.returncode == 2, direct.stdout[-3000:]
    assert f"coordinator=127.0.0.1:{port}: port {port} is already in use" in direct.stdout


def test_a_port_in_time_wait_is_free_and_a_listening_one_is_not():
    """The port of a coordinator that just died lingers in TIME_WAIT for about a minute; a
    restart must be able to take it (the coordinator binds with SO_REUSEADDR, as jax's gRPC
    server does)."""
    from meshtrain.distributed import port_is_free

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_is_free(port)  # something listens
        with socket.create_connection(("127.0.0.1", port)) as client:
            server, _ = listener.accept()
            server.close()  # the side that closes first keeps the port in TIME_WAIT
            client.recv(1)
    plain = socket.socket()
    with plain:
        with pytest.raises(OSError):  # a bind without SO_REUSEADDR is refused meanwhile
            plain.bind(("127.0.0.1", port))
    assert port_is_free(port)


def test_launcher_prefixes_output_and_propagates_the_first_failure():
    """Process 1 fails with code 3 while process 0 sleeps: the launcher returns 3, quickly."""
    script = (
        "import os, sys, time\n"
        "r = int(os.environ['MESHTRAIN_PROCESS_ID'])\n"
        "print('hello from', r, 'of', os.environ['MESHTRAIN_NUM_PROCESSES'], flush=True)\n"
        "if r == 1:\n    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    start = time.monotonic()
    done = _meshtrain("launch", "--nproc", "2", "--grace", "1", "--", sys.executable, "-c", script)
    took = time.monotonic() - start
    assert done.returncode == 3, done.stdout
    assert "[p0] hello from 0 of 2" in done.stdout and "[p1] hello from 1 of 2" in done.stdout
    assert "[launch] process 1 failed (exit code 3); stopping process(es) 0" in done.stdout
    assert took < 60, f"the launcher took {took:.0f} s to stop the sleeping process"


def plan(argv):
    """The launcher's (command, devices per process) for `argv` (the words after launch)."""
    return plan_launch(parse_launch(argv))


def test_launcher_plan_defaults_and_errors():
    cmd, k = plan(["--nproc", "2", "--", "train", "--steps", "5"])
    assert k == 4 and cmd[-5:] == ["train", "--devices", "4", "--steps", "5"]
    cmd, k = plan(["--nproc", "2", "--", "train", "--devices", "3"])
    assert k == 3 and cmd.count("--devices") == 1
    cmd, k = plan(["--nproc", "4", "--devices-per-proc", "1", "--", "python", "x.py"])
    assert (k, cmd) == (1, ["python", "x.py"])
    with pytest.raises(ValueError, match="--devices-per-proc 2 and train --devices 3 disagree"):
        plan(["--nproc", "2", "--devices-per-proc", "2", "--", "train", "--devices", "3"])
    with pytest.raises(ValueError, match="launch --nproc 0: must be ≥ 1"):
        plan(["--nproc", "0", "--", "train"])
    with pytest.raises(ValueError, match="no command"):
        plan(["--nproc", "2"])
    with pytest.raises(ValueError, match="train --devices 'x': must be a whole number"):
        plan(["--nproc", "2", "--", "train", "--devices", "x"])


def test_process_rows_and_explicit_rows():
    """One process holds every row; a dataset reads exactly the rows it is given."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("hsdp+tp", mesh)
    assert process_rows(mesh, rules, 8) == (0, 8)
    with pytest.raises(ValueError, match="batch_size=6 does not split over the 4"):
        process_rows(mesh, rules, 6)
    data = make_dataset(DataConfig(source="synthetic", seq_len=8, batch_size=8, seed=5))
    whole = next(data.train_iter())["inputs"]
    np.testing.assert_array_equal(next(data.train_iter((2, 6)))["inputs"], whole[2:6])
    np.testing.assert_array_equal(data.eval_batches(1, (4, 8))[0]["inputs"],
                                  data.eval_batches(1)[0]["inputs"][4:8])  # fmt: skip
    with pytest.raises(ValueError, match=r"data rows=\(6, 2\): expected 0 ≤ lo < hi ≤ batch"):
        data.train_iter((6, 2))


@pytest.mark.parametrize(
    ("sizes", "n_proc", "local", "across", "within"),
    [
        ({"data": 8}, 2, 4, {"data": 2}, {"data": 4}),
        ({"data": 2, "fsdp": 2, "tensor": 2}, 2, 4, {"data": 2}, {"fsdp": 2, "tensor": 2}),
        ({"pipe": 2, "data": 2, "tensor": 2}, 2, 4, {"pipe": 2}, {"data": 2, "tensor": 2}),
        ({"pipe": 2, "data": 4}, 4, 2, {"pipe": 2, "data": 2}, {"data": 2}),
        ({"pipe": 3, "data": 2, "tensor": 2}, 2, 6, {"data": 2}, {"pipe": 3, "tensor": 2}),
    ],
)
def test_host_layout_puts_outer_axes_across_processes(sizes, n_proc, local, across, within):
    full = {a: sizes.get(a, 1) for a in ("pipe", "data", "fsdp", "expert", "seq", "tensor")}
    got_across, got_within = host_layout(full, n_proc, local)
    assert {a: v for a, v in got_across.items() if v > 1} == across
    assert {a: v for a, v in got_within.items() if v > 1} == within
    assert all(got_across[a] * got_within[a] == full[a] for a in full)


@pytest.mark.parametrize(
    ("sizes", "n_proc", "local"),
    [({"tensor": 8}, 2, 4), ({"data": 3, "tensor": 2}, 2, 3), ({"pipe": 2, "fsdp": 2}, 4, 1)],
)
def test_host_layout_rejects_inner_axes_across_processes(sizes, n_proc, local):
    full = {a: sizes.get(a, 1) for a in ("pipe", "data", "fsdp", "expert", "seq", "tensor")}
    with pytest.raises(ValueError, match=f"cannot be laid out on {n_proc} processes"):
        host_layout(full, n_proc, local)


def test_distributed_config_reads_environment_and_validates(monkeypatch):
    for var in ("MESHTRAIN_COORDINATOR", "MESHTRAIN_NUM_PROCESSES", "MESHTRAIN_PROCESS_ID",
                "JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                "OMPI_COMM_WORLD_SIZE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert not DistributedConfig().wanted()
    monkeypatch.setenv("SLURM_NTASKS", "4")  # an sbatch script: still one process
    assert not DistributedConfig().wanted()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # srun with 4 tasks
    assert DistributedConfig().wanted() and not DistributedConfig(mode="off").wanted()
    monkeypatch.setenv("MESHTRAIN_NUM_PROCESSES", "4")
    monkeypatch.setenv("MESHTRAIN_HEARTBEAT_TIMEOUT", "7")
    cfg = DistributedConfig.from_env(DistributedConfig(num_processes=2))
    assert (cfg.num_processes, cfg.heartbeat_timeout_s) == (2, 7)  # explicit beats environment
    with pytest.raises(ValueError, match="dist.process_id=2: with num_processes=2"):
        DistributedConfig(num_processes=2, process_id=2)
    with pytest.raises(ValueError, match=r"dist.coordinator='nohost': expected host:port"):
        DistributedConfig(coordinator="nohost")
    with pytest.raises(ValueError, match="dist.heartbeat_timeout_s=0: must be a positive integer"):
        DistributedConfig(heartbeat_timeout_s=0)
    monkeypatch.setenv("MESHTRAIN_PROCESS_ID", "one")
    with pytest.raises(ValueError, match="MESHTRAIN_PROCESS_ID='one': must be an integer"):
        DistributedConfig.from_env()
