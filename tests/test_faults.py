"""Fault injection: `capt train` killed with SIGKILL at every kind of write, and a disk that fills up.

After each, `--resume` (or, where nothing resumable was left, the printed advice: `--overwrite`) ends with the
scores and weights of an uninterrupted run. The pauses come from `capt.recipes.train.pause_point`
(CAPT_PAUSE_AT=<point>@<n>), so each kill lands at an exact place.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
RUN = ["--model", "tiny-llama", "--data-dir", str(DATA), "--limit-train", "16", "--limit-eval", "16", "--epochs", "2"]
RUN += ["--batch-size", "4", "--checkpoint-every", "2"]
ARGS = ["train", "--task", "cb", "--lr", "0.05", *RUN]
# The same run as a sweep cell: one grid point (seed 0) and one more seed.
SWEEP = ["sweep", "--tasks", "cb", "--methods", "capt", "--lr-grid", "capt=0.05", "--seeds", "2", *RUN]
SWEEP += ["--no-references"]


def _capt(
    tmp_path: Path, out: Path, *extra: str, pause: str | None = None, args: list[str] = ARGS
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(tmp_path), "CAPT_PAUSE_AT": pause or ""}
    command = [sys.executable, "-m", "capt.recipes.cli", *args, "--output-dir", str(out), *extra]
    if pause is None:
        return subprocess.run(command, env=env, capture_output=True, text=True)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:
        if line.startswith("CAPT_PAUSED"):
            process.send_signal(signal.SIGKILL)
            break
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"the run ended before it reached {pause}"
    return subprocess.CompletedProcess(command, process.returncode)


def _same_run(got: Path, expected: Path) -> None:
    summary = json.loads((got / "results.json").read_text())
    reference = json.loads((expected / "results.json").read_text())
    assert summary["test"] == reference["test"]
    assert summary["runs"][0]["best_epoch"] == reference["runs"][0]["best_epoch"]
    for name, tensor in load_file(expected / "trainable.safetensors").items():
        assert torch.equal(load_file(got / "trainable.safetensors")[name], tensor), name
    assert not (got / "checkpoint.pt").exists()
    assert not list(got.glob(".*.tmp"))  # no torn temporary file is left behind
    steps = [json.loads(line) for line in (got / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(1, 9))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    done = _capt(tmp, tmp / "run")
    assert done.returncode == 0, done.stderr
    return tmp / "run"


# Two kill points run in the default suite; the other four (a minute each) with `make test-slow`.
@pytest.mark.parametrize(
    "pause",
    [
        "checkpoint@3",  # inside the atomic write of the epoch-1 checkpoint (after two mid-epoch ones)
        pytest.param("checkpoint@6", marks=pytest.mark.slow),  # inside the last checkpoint's write
        pytest.param("trainable@1", marks=pytest.mark.slow),  # best weights written, adapter not yet
        pytest.param("adapter@1", marks=pytest.mark.slow),  # adapter written, results.json not yet
        "results@1",  # results.json written, the checkpoint not yet removed
        pytest.param("summary@1", marks=pytest.mark.slow),  # the seed's results written, the summary over seeds not yet
    ],
)
def test_a_kill_anywhere_resumes_to_the_uninterrupted_result(pause, reference, tmp_path):
    out = tmp_path / "run"
    _capt(tmp_path, out, pause=pause)
    resumed = _capt(tmp_path, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _same_run(out, reference)


def test_a_kill_before_the_first_checkpoint_says_to_start_again(reference, tmp_path):
    out = tmp_path / "run"
    _capt(tmp_path, out, pause="checkpoint@1")
    resumed = _capt(tmp_path, out, "--resume")
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    assert "no checkpoint.pt" in resumed.stderr and "--overwrite" in resumed.stderr
    again = _capt(tmp_path, out, "--overwrite")
    assert again.returncode == 0, again.stderr
    _same_run(out, reference)


def test_an_overwrite_killed_mid_training_leaves_the_old_run_whole(reference, tmp_path, monkeypatch):
    """The old settings, weights and results stay together (and `capt eval` works) until the new run finishes;
    `--resume` then completes the overwrite, checked against the settings its checkpoint holds."""
    from capt.recipes.cli import main

    out = tmp_path / "run"
    assert _capt(tmp_path, out, "--lr", "0.02").returncode == 0  # the finished run to overwrite
    finished = ("results.json", "run_config.json", "trainable.safetensors")
    kept = {name: (out / name).read_bytes() for name in finished}
    _capt(tmp_path, out, "--overwrite", pause="checkpoint@3")  # the new run (--lr 0.05), killed in epoch 1
    assert {name: (out / name).read_bytes() for name in finished} == kept
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["eval", "--adapter", str(out)]) == 0
    refused = _capt(tmp_path, out)
    assert refused.returncode == 1 and "pass --resume to complete the re-run" in refused.stderr
    resumed = _capt(tmp_path, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _same_run(out, reference)
    assert json.loads((out / "run_config.json").read_text())["lr"] == 0.05


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="mounting a tmpfs needs root on Linux")
def test_a_full_disk_is_one_clear_line_and_keeps_the_checkpoint(reference, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "run"
        _capt(tmp_path, out, pause="trainable@1")
        checkpoint = (out / "checkpoint.pt").read_bytes()
        filler = disk / "filler"
        with filler.open("wb", buffering=0) as handle:  # fill the disk to the last byte
            try:
                while True:
                    handle.write(b"\0" * 4096)
            except OSError:
                pass
        full = _capt(tmp_path, out, "--resume")
        assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr
        assert "No space left on device" in full.stderr or "disk full?" in full.stderr
        assert (out / "checkpoint.pt").read_bytes() == checkpoint  # the previous files are intact
        filler.unlink()
        resumed = _capt(tmp_path, out, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        _same_run(out, reference)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _seed_run(sweep: Path, seed: int) -> Path:
    return sweep / "cb" / "capt" / ("grid/lr-0.05" if seed == 0 else f"seed-{seed}")


@pytest.fixture(scope="module")
def reference_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference-sweep")
    done = _capt(tmp, tmp / "sweep", args=SWEEP)
    assert done.returncode == 0, done.stderr
    return tmp / "sweep"


def test_a_killed_sweep_continues_its_interrupted_run_to_the_uninterrupted_result(reference_sweep, tmp_path):
    out = tmp_path / "sweep"
    _capt(tmp_path, out, args=SWEEP, pause="checkpoint@9")  # seed 1's third checkpoint: the grid point is done
    again = _capt(tmp_path, out, args=SWEEP)  # the same command, no flag
    assert again.returncode == 0, again.stderr
    assert "resuming at epoch 1, batch 4 (step 4)" in again.stdout  # from seed 1's second checkpoint, not from 0
    for seed in (0, 1):
        _same_run(_seed_run(out, seed), _seed_run(reference_sweep, seed))
    cell, expected = (json.loads((s / "cb" / "capt" / "results.json").read_text()) for s in (out, reference_sweep))
    assert cell["test"] == expected["test"] and cell["chosen_lr"] == expected["chosen_lr"]


def test_a_run_carried_to_another_sessions_folder_resumes_there(reference_sweep, tmp_path):
    """The study's carry-over (results/<study>/in-flight/, docs/study-mean-norm.md): a grid point killed in one
    session, its folder committed as git keeps it (no lock, no temporary file), resumes in the next session's sweep
    under another --output-dir, to the uninterrupted result."""
    first = tmp_path / "first-session"
    _capt(tmp_path, first, args=SWEEP, pause="checkpoint@3")  # the grid point, writing its epoch-1 checkpoint
    carried = tmp_path / "next-session"
    shutil.copytree(_seed_run(first, 0), _seed_run(carried, 0), ignore=shutil.ignore_patterns(".capt.lock", "*.tmp"))
    again = _capt(tmp_path, carried, args=SWEEP)
    assert again.returncode == 0, again.stderr
    assert "resuming at epoch 1, batch 4 (step 4)" in again.stdout  # from its last whole checkpoint
    for seed in (0, 1):
        _same_run(_seed_run(carried, seed), _seed_run(reference_sweep, seed))


@pytest.mark.slow  # a variant of the killed sweep the default suite resumes (15 s)
def test_a_killed_sweep_started_again_with_other_settings_starts_the_run_over(reference_sweep, tmp_path):
    out = tmp_path / "sweep"
    _capt(tmp_path, out, args=SWEEP, pause="checkpoint@3")  # the grid point, at the end of epoch 1 of 2
    assert (_seed_run(out, 0) / "checkpoint.pt").exists()
    again = _capt(tmp_path, out, "--epochs", "3", args=SWEEP)
    assert again.returncode == 0, again.stderr
    assert "resuming" not in again.stdout
    steps = [json.loads(line) for line in (_seed_run(out, 0) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(1, 13))  # 3 epochs from step 1


@pytest.mark.slow  # a variant of the killed sweep the default suite resumes (15 s)
def test_a_killed_comparison_keeps_its_finished_seeds_and_continues_the_interrupted_one(reference, tmp_path):
    out = tmp_path / "compare"
    argv = ["compare", "--tasks", "cb", "--methods", "capt", "--seeds", "2", "--lr", "0.05", *RUN]
    _capt(tmp_path, out, args=argv, pause="checkpoint@9")  # seed 0 finished, seed 1 in its first epoch
    seed_0 = out / "cb" / "capt" / "seed-0"
    stamp = (seed_0 / "trainable.safetensors").stat().st_mtime_ns
    again = _capt(tmp_path, out, args=argv)
    assert again.returncode == 0, again.stderr
    assert "resuming at epoch 1, batch 4 (step 4)" in again.stdout
    assert (seed_0 / "trainable.safetensors").stat().st_mtime_ns == stamp  # read back, not trained again
    _same_run(seed_0, reference)  # `capt train` with the same settings and seed
    assert len(json.loads((out / "cb" / "capt" / "results.json").read_text())["runs"]) == 2
