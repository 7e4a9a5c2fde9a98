"""Production hardening: crash-safe resume, NaN losses, data parallelism, and clear errors on bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from capt.recipes.cli import main
from capt.recipes.run import RunConfig
from capt.recipes.train import train

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny-llama", "--task", "rte", "--limit-eval", "12", "--data-dir", str(DATA)]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "capt.recipes.cli", *args]


def _steps_logged(run: Path) -> int:
    log = run / "metrics.jsonl"
    return log.read_text().count('"kind": "step"') if log.exists() else 0


@pytest.mark.slow  # test_faults.py kills and resumes at every write; this is its plain kill -9 case (24 s)
def test_resume_after_kill_9_equals_an_uninterrupted_run(tmp_path):
    args = [
        "train",
        *TINY,
        "--limit-train",
        "48",
        "--batch-size",
        "4",
        "--epochs",
        "3",
        "--lr",
        "0.05",
        "--checkpoint-every",
        "3",
    ]
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    env = {**os.environ, "HOME": str(tmp_path)}
    subprocess.run(_cli(*args, "--output-dir", str(reference)), check=True, env=env, capture_output=True)

    process = subprocess.Popen(
        _cli(*args, "--output-dir", str(crashed)), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while _steps_logged(crashed) < 17 and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)  # kill in the middle of epoch 2, between two checkpoints
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (crashed / "results.json").exists(), "the run finished before it could be killed"
    assert (crashed / "checkpoint.pt").exists()

    subprocess.run(_cli(*args, "--output-dir", str(crashed), "--resume"), check=True, env=env, capture_output=True)
    assert not (crashed / "checkpoint.pt").exists()  # a finished run leaves no checkpoint behind
    expected = json.loads((reference / "results.json").read_text())["runs"][0]
    got = json.loads((crashed / "results.json").read_text())["runs"][0]
    assert got["test"] == expected["test"]
    assert (got["best_epoch"], got["epochs_run"]) == (expected["best_epoch"], expected["epochs_run"])
    for name, tensor in load_file(reference / "trainable.safetensors").items():
        assert torch.equal(load_file(crashed / "trainable.safetensors")[name], tensor), name
    steps = [
        json.loads(line)["step"]
        for line in (crashed / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in line
    ]
    assert steps == list(range(1, 37))  # the log holds each step once, the redone ones included


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "nothing"
    assert main(["train", *TINY, "--limit-train", "8", "--output-dir", str(out), "--resume"]) == 1
    assert "no checkpoint.pt" in capsys.readouterr().err


def test_a_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from capt.recipes import formats

    calls = {"n": 0}
    real_loss = formats.CausalLMFormat.loss

    def loss_that_breaks(self, model, batch):
        calls["n"] += 1
        value = real_loss(self, model, batch)
        return value * float("nan") if calls["n"] == 5 else value

    monkeypatch.setattr(formats.CausalLMFormat, "loss", loss_that_breaks)
    config = RunConfig(
        model="tiny-llama",
        task="rte",
        limit_train=32,
        limit_eval=8,
        batch_size=4,
        epochs=1,
        checkpoint_every=2,
        data_dir=str(DATA),
        output_dir=str(tmp_path / "run"),
    )
    with pytest.raises(FloatingPointError, match="step 5"):
        train(config)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["progress"]["step"] == 4


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_bf16_is_flagged_slow_only_on_a_cpu_without_bf16_matrix_support(fast_bf16, monkeypatch):
    from capt.recipes import train as training

    monkeypatch.setattr(training, "cpu_has_fast_bf16", lambda: fast_bf16)
    cpu, bf16 = torch.device("cpu"), RunConfig(bf16=True)
    assert training.slow_bf16(bf16, cpu) is not fast_bf16
    assert not training.slow_bf16(RunConfig(bf16=False), cpu)
    assert not training.slow_bf16(bf16, torch.device("meta"))  # an accelerator: bf16 is its fast path


def test_capt_train_bf16_warns_on_this_cpu_exactly_when_it_is_slow(tmp_path):
    from capt.recipes.train import SLOW_BF16_WARNING, cpu_has_fast_bf16

    out = tmp_path / "run"
    argv = _cli("train", *TINY, "--limit-train", "4", "--epochs", "1", "--bf16", "--output-dir", str(out))
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (SLOW_BF16_WARNING in done.stdout + done.stderr) is not cpu_has_fast_bf16()


def test_the_bf16_probe_matches_the_cpu_flags():
    from capt.recipes.train import cpu_has_fast_bf16

    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else None
    if flags is None or "GenuineIntel" not in flags and "AuthenticAMD" not in flags:
        pytest.skip("x86 Linux only")
    assert cpu_has_fast_bf16() == ({"avx512bw", "avx512vl", "avx512dq"} <= set(flags) or "amx_bf16" in flags)


@pytest.mark.skipif(sys.platform != "linux", reason="gloo process group on Linux")
def test_two_processes_give_the_metrics_of_one_with_the_same_global_batch(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    common = ["train", *TINY, "--limit-train", "32", "--epochs", "2", "--lr", "0.05"]
    subprocess.run(
        _cli(*common, "--batch-size", "8", "--output-dir", str(tmp_path / "one")),
        check=True,
        env=env,
        capture_output=True,
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "capt.recipes.cli"]
    subprocess.run(
        [*launcher, *common, "--batch-size", "4", "--output-dir", str(tmp_path / "two")],
        check=True,
        env=env,
        capture_output=True,
    )
    one = json.loads((tmp_path / "one" / "results.json").read_text())["runs"][0]
    two = json.loads((tmp_path / "two" / "results.json").read_text())["runs"][0]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["test"] == one["test"]
    assert two["best_validation_score"] == one["best_validation_score"]
    for name, tensor in load_file(tmp_path / "one" / "trainable.safetensors").items():
        assert torch.allclose(load_file(tmp_path / "two" / "trainable.safetensors")[name], tensor, atol=1e-5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "no/such-model-here"], "cannot load model 'no/such-model-here'"),
        (["--variant", "multiply"], "variant must be one of"),
        (["--task", "boolq"], "BoolQ/train.jsonl"),
        (["--optimizer", "sgd"], "unknown optimizer 'sgd'"),
        (["--epochs", "0"], "epochs must be >= 1"),
    ],
)
def test_bad_arguments_get_a_clear_error(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["train", "--model", "tiny-llama", "--task", "rte", "--data-dir", str(DATA), "--limit-train", "8"]
    assert main([*args, *argv, "--output-dir", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_data_folder_with_the_wrong_layout_names_the_missing_file(tmp_path, capsys):
    (tmp_path / "data" / "rte").mkdir(parents=True)  # lower-case folder: not the official layout
    assert (
        main(
            [
                "train",
                "--model",
                "tiny-llama",
                "--data-dir",
                str(tmp_path / "data"),
                "--output-dir",
                str(tmp_path / "out"),
            ]
        )
        == 1
    )
    assert "RTE/train.jsonl" in capsys.readouterr().err


def test_an_unwritable_output_folder_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["train", *TINY, "--limit-train", "8", "--output-dir", str(blocker / "run")]) == 1
    assert str(blocker) in capsys.readouterr().err


def test_trust_remote_code_is_off_unless_asked():
    assert RunConfig().trust_remote_code is False
    from capt.recipes.cli import _parser, run_config

    assert run_config(_parser().parse_args(["train", "--trust-remote-code"])).trust_remote_code is True
