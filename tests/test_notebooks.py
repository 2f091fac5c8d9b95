"""Runs every notebook in notebooks/ top to bottom in a fresh kernel, as a user would.

Each notebook executes in its own ipykernel process started from this interpreter, with no
device count in its ``XLA_FLAGS`` (conftest.py sets one for the test process; a user's fresh
kernel has none, so the notebook's own ``mt.simulate_devices`` must do the work), only the
suite's cheap compiles. Any cell error fails the test.
"""

import re
import sys
from pathlib import Path

import nbformat
import pytest
from _helpers import FAST_COMPILE, fresh_env
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Prepended to the in-memory copy of each notebook (never saved): reports what the kernel runs on.
PROBE = (
    "import os as _os, sys as _sys\n"
    "print('PROBE', repr(_sys.executable), repr(_os.environ.get('XLA_FLAGS')), sep='\\t')"
)
FINAL_LOSSES = re.compile(r"^final losses: (.+)$", re.MULTILINE)
# Same seed and data under dp / fsdp / tp: only float reduction order differs (≈1e-7 here).
LOSS_TOLERANCE = 1e-3


def _text(cell) -> str:
    """A code cell's printed and displayed text, concatenated."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def _execute(path: Path):
    """Executes `path` in a fresh python3 kernel without a device count; returns the notebook."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))
    env = fresh_env()
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute(env=env)
    return nb


def _check_quickstart(nb) -> None:
    """The three strategies trained, learned something, and agree."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    match = FINAL_LOSSES.search(text)
    assert match, "the quickstart must print a line 'final losses: dp=..., fsdp=..., tp=...'"
    losses = {k.strip(): float(v) for k, v in (p.split("=") for p in match.group(1).split(","))}
    assert set(losses) == {"dp", "fsdp", "tp"}, losses
    spread = max(losses.values()) - min(losses.values())
    assert spread < LOSS_TOLERANCE, f"strategies disagree by {spread:.2e}: {losses}"
    # A byte-level model starts at ln(256) ≈ 5.55 nats; 20 steps must get well below it.
    assert all(loss < 4.5 for loss in losses.values()), losses
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    ), "the loss-curve plot produced no image"


MAX_ERROR = re.compile(r"^max relative error: (\S+)$", re.MULTILINE)


def _check_kernels(nb) -> None:
    """Every kernel matched its reference; the roofline drew; GPU timings shown or unmeasured."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    match = MAX_ERROR.search(text)
    assert match, "the kernels notebook must print 'max relative error: ...'"
    assert float(match.group(1)) < 1e-4, match.group(0)
    assert "GPU timings unmeasured" in text or "vs cuDNN" in text
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    ), "the roofline plot produced no image"


def _check_pipelines(nb) -> None:
    """The 1F1B run matched the unpipelined one, and the charts were drawn."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    match = FINAL_LOSSES.search(text)
    assert match, "the pipelines notebook must print 'final losses: 1f1b=..., unpipelined=...'"
    losses = {k.strip(): float(v) for k, v in (p.split("=") for p in match.group(1).split(","))}
    assert set(losses) == {"1f1b", "unpipelined"}, losses
    assert abs(losses["1f1b"] - losses["unpipelined"]) < 1e-4, losses
    assert losses["1f1b"] < 4.5, losses
    ratio = re.search(r"1f1b / gpipe = ([\d.]+)", text)
    assert ratio and float(ratio.group(1)) < 1.0, "1F1B must need less memory than gpipe"
    images = sum(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )
    assert images >= 3, f"expected the Gantt, bubble and loss plots, got {images} images"


def _check_checkpoints(nb) -> None:
    """Saved on 8 devices, restored exactly onto 4 under FSDP, and the continuations agree."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "steps on disk: [10, 20]" in text, text
    assert "identical values: True" in text, text
    assert "resumed at step 20 on fsdp=4 (4 cpu devices)" in text, text
    match = re.search(r"final losses: 8 devices=([\d.]+), 4 devices=([\d.]+)", text)
    assert match, "the notebook must print 'final losses: 8 devices=..., 4 devices=...'"
    eight, four = map(float, match.groups())
    # Same function, another reduction order: float32 rounding only, over 20 steps.
    assert abs(eight - four) < LOSS_TOLERANCE, (eight, four)
    assert eight < 4.5, eight  # it learned (ln 256 ≈ 5.55 at the start)
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    ), "the loss-curve plot produced no image"


def _check_multihost(nb) -> None:
    """Two launched processes joined one 8-device job and trained like one process."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    for rank in (0, 1):
        assert f"[p{rank}] meshtrain: process {rank} of 2 · 4 local cpu devices · 8 global" in text
    assert "process 0: reads batch rows [0, 4]" in text, "process 0 must read rows 0-3 only"
    assert "process 1: reads batch rows [4, 8]" in text, "process 1 must read rows 4-7 only"
    match = FINAL_LOSSES.search(text)
    assert match, "the multihost notebook must print 'final losses: 2x4=..., 1x8=...'"
    losses = {k.strip(): float(v) for k, v in (p.split("=") for p in match.group(1).split(","))}
    assert set(losses) == {"2x4", "1x8"}, losses
    assert abs(losses["2x4"] - losses["1x8"]) < 1e-4, losses
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    ), "the mesh / batch figure produced no image"


def _check_long_context(nb) -> None:
    """Ring attention on seq=8 cuts per-device memory at least 8× at 4k tokens; zig-zag
    balances the causal work exactly."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    # 4k, not longer: the ring's compile grows with the length (about 7 CPU-s at 4k, 30 at
    # 32k), and the ratio is already far above 8 at 4k (it grows with the length).
    match = re.search(r"memory ratio at 4k: ([\d.]+)", text)
    assert match and float(match.group(1)) >= 8, text
    assert "balanced work per device: [17, 17, 17, 17, 17, 17, 17, 17]" in text, text
    assert "naive work per device: [3, 7, 11, 15, 19, 23, 27, 31]" in text, text


def _check_moe(nb) -> None:
    """Dropless drops nothing, capacity 1.0 drops more than 1.25, the plot drew, and the
    compiled all-to-all bytes are capacity_factor × the analytic count."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    dropped = dict(
        re.findall(r"^(capacity 1\.0|capacity 1\.25|dropless)\s.*dropped ([\d.]+)%", text, re.M)
    )
    assert set(dropped) == {"capacity 1.0", "capacity 1.25", "dropless"}, text
    assert float(dropped["dropless"]) == 0.0
    assert float(dropped["capacity 1.0"]) >= float(dropped["capacity 1.25"]) > 0.0, dropped
    assert "ratio 1.25 = capacity_factor 1.25" in text, text
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    ), "the expert-load plot produced no image"


def _check_finetune(nb) -> None:
    """The fine-tune trained, the export gave the run's logits, a contradicting flag exited 2
    before compiling, and the tokenizer sampled text."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "round trip: True" in text, text
    losses = re.search(r"loss: first ([\d.]+), last ([\d.]+)", text)
    assert losses and float(losses.group(2)) < float(losses.group(1)) - 0.5, text
    assert "'config.json', 'model.safetensors', 'tokenizer.json'" in text, text
    assert "exit code 2" in text, text
    match = re.search(r"max \|logit difference\|: (\S+)", text)
    assert match and float(match.group(1)) < 1e-4, text
    assert "same tokens: True" in text or "transformers is not installed" in text, text


def _named_values(text: str, label: str) -> dict[str, float]:
    """``label: a=1, b c=2`` printed by a notebook, as ``{"a": 1.0, "b c": 2.0}``."""
    match = re.search(rf"^{label}: (.+)$", text, re.MULTILINE)
    assert match, f"the notebook must print a line '{label}: name=value, ...'"
    return {k.strip(): float(v) for k, v in (p.rsplit("=", 1) for p in match.group(1).split(", "))}


def _check_communicating_less(nb) -> None:
    """Every scheme trained from the same start; lossless-enough codes track fp32; the
    inspected bytes per step are bf16 ½, int8 ¼ of fp32's, local SGD's fall as 1/H and
    staleness sends what synchronous training sends."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    losses = _named_values(text, "final losses")
    sent = _named_values(text, "bytes per step")
    codecs = [c + s for c in ("bf16", "int8", "topk:0.01", "sign") for s in ("", "+ef")]
    local = [f"{k} H={h}" for k in ("local", "diloco") for h in (1, 8)]
    stale = [f"staleness {s}" for s in (0, 1, 4)]
    assert set(losses) == set(sent) == {"none", *codecs, *local, *stale}, sorted(losses)
    assert all(0 < v < 5.6 for v in losses.values()), losses  # finite, below ln 256 + noise
    assert losses["none"] < 4.5, losses  # it learned
    for name in ("bf16+ef", "int8+ef"):
        assert abs(losses[name] - losses["none"]) < 0.05 * losses["none"], losses
    ratio = {k: v / sent["none"] for k, v in sent.items()}
    assert 0.45 <= ratio["bf16+ef"] <= 0.55 and 0.225 <= ratio["int8+ef"] <= 0.275, ratio
    assert ratio["sign+ef"] < ratio["int8+ef"] and ratio["topk:0.01+ef"] < ratio["int8+ef"]
    assert all(0.1 < ratio[f"{k} H=8"] < 0.15 < ratio[f"{k} H=1"] for k in ("local", "diloco"))
    assert all(sent[k] == sent["none"] for k in stale), sent
    assert any(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    ), "the loss curves produced no image"


def _check_decentralized(nb) -> None:
    """The complete graph keeps the replicas together, the exponential graph mixes faster than
    the ring; the α = 0.1 partition is skewed and the i.i.d. one is not; every run learned."""
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    consensus = _named_values(text, "consensus")
    assert set(consensus) == {"ring", "exponential", "complete"}, consensus
    assert consensus["complete"] < 1e-4 < consensus["exponential"] < consensus["ring"], consensus
    skew = _named_values(text, "skew")
    assert skew["i.i.d."] < 0.2 and skew["α=0.1"] > 0.4, skew
    accuracy = _named_values(text, "accuracy")
    assert set(accuracy) == {"synchronous", "i.i.d.", "α=0.1"}, accuracy
    assert all(0.2 < a <= 1 for a in accuracy.values()), accuracy  # chance is 0.1
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # the two figures


CHECKS = {
    "01_quickstart.ipynb": _check_quickstart,
    "02_pipelines.ipynb": _check_pipelines,
    "03_kernels.ipynb": _check_kernels,
    "04_checkpoints.ipynb": _check_checkpoints,
    "05_multihost.ipynb": _check_multihost,
    "07_moe.ipynb": _check_moe,
    "08_long_context.ipynb": _check_long_context,
    "09_communicating_less.ipynb": _check_communicating_less,
    "11_finetune.ipynb": _check_finetune,
    "12_decentralized.ipynb": _check_decentralized,
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_saved_with_the_outputs_of_one_clean_run(path):
    """Notebooks are committed executed (`scripts/execute_notebooks.py`), so the docs site shows
    their outputs: every code cell ran once, top to bottom, without an error, and no output
    names the absolute path of the checkout that ran it."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"execution counts {counts}: run python scripts/execute_notebooks.py {path.name}"
    )
    assert any(c.outputs for c in code), "no saved outputs: run scripts/execute_notebooks.py"
    for i, cell in enumerate(code, 1):
        assert not [o for o in cell.outputs if o.output_type == "error"], f"cell {i} failed"
        assert str(ROOT) not in _text(cell), f"cell {i}'s output names {ROOT}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nb = _execute(path)
    probe = _text(nb.cells[0]).strip().split("\t")
    assert probe[0] == "PROBE", probe
    assert probe[1] == repr(sys.executable), f"kernel ran {probe[1]}, not {sys.executable!r}"
    assert probe[2] == repr(FAST_COMPILE), f"kernel started with XLA_FLAGS={probe[2]}"
    check = CHECKS.get(path.name)
    if check is not None:
        check(nb)


def test_quickstart_is_collected():
    assert {"01_quickstart.ipynb", "04_checkpoints.ipynb"} <= {p.name for p in NOTEBOOKS}


def test_kernels_notebook_is_collected():
    assert "03_kernels.ipynb" in {p.name for p in NOTEBOOKS}
