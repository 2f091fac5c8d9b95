"""`meshtrain plan`: a 64-device plan in seconds, bad input as one line, `--write` trains."""

import json
import time

import pytest

from meshtrain.cli import main


def _err(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_64_device_plan_for_a_1_3b_gpt_is_quick_and_keeps_its_memory_analytic(capsys):
    t0 = time.perf_counter()
    assert main(["plan", "--model", "1.3b", "--devices", "64", "--json"]) == 0
    wall = time.perf_counter() - t0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert wall < 120
    assert out["compiled"] is False  # 8 simulated devices cannot compile a 64-device program
    flags = out["train_flags"]
    sizes = dict(kv.split("=") for kv in flags["mesh"].split(","))
    n = 1
    for v in sizes.values():
        n *= int(v)
    assert n == 64 and out["modelled_step_s"] > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--devices", "0"], "devices=0: must be a positive integer"),
        (["--devices", "8", "--hosts", "3"], "hosts=3: does not divide devices=8"),
        (["--devices", "5", "--batch", "8"], "none of"),
        (["--device", "b200"], "device='b200': unknown device profile; choose from h100"),
        (["--device-memory", "lots"], "device_memory='lots': not a size"),
        (["--model", "70b"], "model='70b': unknown size"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(capsys, argv, needle):
    code, err = _err(capsys, ["plan", "--confirm", "0", *argv])
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_a_memory_cap_no_layout_fits_names_the_smallest_memory_that_would(capsys):
    code, err = _err(
        capsys, ["plan", "--model", "1.3b", "--devices", "64", "--device-memory", "1GB"]
    )
    assert code == 2 and len(err) == 1
    assert "no layout of 64 devices fits; the smallest needs" in err[0]
    need = err[0].split("--device-memory ")[1].split("GB")[0]
    # that much does fit
    assert (
        main(
            [
                "plan",
                "--model",
                "1.3b",
                "--devices",
                "64",
                "--device-memory",
                f"{float(need) * 1.01:.3f}GB",
                "--json",
            ]
        )
        == 0
    )


@pytest.mark.slow
def test_the_written_plan_trains(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--devices", "8", "--device", "cpu-sim", "--confirm", "0"]
    assert main([*argv, "--write", str(path)]) == 0
    flags = json.loads(path.read_text())
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--config",
                str(path),
                "--steps",
                "2",
                "--no-save",
                "--sample-tokens",
                "0",
                "--run-dir",
                "",
                "--data.source",
                "synthetic",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"strategy {flags['strategy']}" in out and "final loss" in out


def test_config_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code, err = _err(capsys, ["train", "--config", str(bad)])
    assert code == 2 and "must hold a JSON object" in err[0]
    code, err = _err(capsys, ["train", "--config", str(tmp_path / "missing.json")])
    assert code == 2 and "cannot read" in err[0]


def test_inspect_takes_the_train_flags_and_refuses_a_bad_mesh_before_compiling(capsys):
    code, err = _err(capsys, ["inspect", "--mesh", "data=3", "--json"])
    assert code == 2 and len(err) == 1 and "data=3" in err[0], err


def test_config_flags_come_first_so_the_command_line_wins(tmp_path):
    from meshtrain.cli import parse

    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"mesh": "fsdp=8", "strategy": "fsdp", "gpt.remat": "full", "save": False})
    )
    job = parse(["train", "--config", str(path), "--mesh", "data=8"])
    assert (job.mesh, job.strategy, job.gpt.remat, job.save) == ("data=8", "fsdp", "full", False)
