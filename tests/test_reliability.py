"""Issue 38, the CLI and its files: an input is never overwritten, undecodable files and misplaced settings get
one line naming the file (and line) or the flag, damaged results name their file."""

import json
import os
import socket
from pathlib import Path

import pytest

from capt.recipes.cli import main

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
TINY = ["--model", "tiny-llama", "--task", "cb", "--limit-train", "16", "--limit-eval", "8", "--epochs", "1"]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    return err.strip()


def test_predict_never_writes_over_its_input(tmp_path, capsys):
    """--output naming the input (the same path written otherwise, a symbolic or a hard link) is refused before
    anything is read, and the input keeps its bytes."""
    source = tmp_path / "in.jsonl"
    source.write_text((DATA / "CB" / "val.jsonl").read_text().splitlines()[0] + "\n")
    before = source.read_bytes()
    (tmp_path / "symlink.jsonl").symlink_to(source)
    os.link(source, tmp_path / "hardlink.jsonl")
    for output in (source, tmp_path / "." / "in.jsonl", tmp_path / "symlink.jsonl", tmp_path / "hardlink.jsonl"):
        argv = ["predict", "--adapters", f"cb={tmp_path / 'run'}", "--input", str(source), "--output", str(output)]
        assert f"--output {output} is the --input file" in _error(capsys, argv)
        assert source.read_bytes() == before


@pytest.mark.parametrize(
    ("data", "line", "says"),
    [
        (b"good\n" + "caf\u00e9".encode("latin-1"), 2, "not UTF-8 text (byte 0xe9)"),
        ("{}".encode("utf-16"), 1, "UTF-16 or binary data"),
        ("{}\n{}".encode("utf-16-le"), 1, "UTF-16 or binary data"),
    ],
)
def test_data_and_settings_files_that_are_not_utf8_name_the_file_and_line(data, line, says, tmp_path, capsys):
    folder = tmp_path / "data" / "CB"
    folder.mkdir(parents=True)
    for split in ("train", "val", "test"):
        (folder / f"{split}.jsonl").write_text((DATA / "CB" / f"{split}.jsonl").read_text())
    lines = (DATA / "CB" / "train.jsonl").read_bytes().splitlines(keepends=True)
    if data.startswith(b"good"):  # a bad byte in a real file's line: the file and that line are named
        lines[line - 1] = lines[line - 1].rstrip(b"\n") + data.removeprefix(b"good\n") + b"\n"
        (folder / "train.jsonl").write_bytes(b"".join(lines))
    else:
        (folder / "train.jsonl").write_bytes(data)
    out = tmp_path / "run"
    err = _error(capsys, ["train", *TINY, "--data-dir", str(tmp_path / "data"), "--output-dir", str(out)])
    assert f"{folder / 'train.jsonl'}, line {line}: {says}" in err and len(err.splitlines()) == 1, err

    settings = tmp_path / "study.yaml"
    settings.write_bytes(data.replace(b"good", b"epochs: 1") if data.startswith(b"good") else data)
    err = _error(capsys, ["train", *TINY, "--config", str(settings), "--output-dir", str(out)])
    assert f"{settings}, line {line}: {says}" in err and len(err.splitlines()) == 1, err


def test_resume_with_overwrite_is_refused(tmp_path, capsys):
    err = _error(capsys, ["train", *TINY, "--data-dir", str(DATA), "--output-dir", str(tmp_path), "--resume",
                          "--overwrite"])  # fmt: skip
    assert "--resume continues the run in --output-dir, --overwrite starts it again: give one of them" in err


def test_t5_generate_on_a_decoder_is_warned_as_ignored(tmp_path):
    with pytest.warns(UserWarning, match="--t5-generate applies to T5 .* tiny-llama is decoder: ignored"):
        assert main(["train", *TINY, "--data-dir", str(DATA), "--output-dir", str(tmp_path), "--t5-generate"]) == 0


def test_a_class_the_training_split_lacks_is_warned_naming_it(tmp_path):
    """CB's training file without its 'neutral' examples (validation is cut from it): the test split holds one."""
    folder = tmp_path / "data" / "CB"
    folder.mkdir(parents=True)
    for split in ("val", "test"):
        (folder / f"{split}.jsonl").write_text((DATA / "CB" / f"{split}.jsonl").read_text())
    kept = [line for line in (DATA / "CB" / "train.jsonl").read_text().splitlines() if '"neutral"' not in line]
    (folder / "train.jsonl").write_text("\n".join(kept) + "\n")
    flags = ["--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "run"), "--limit-train", "64"]
    with pytest.warns(UserWarning, match="cb: the test split holds class 'neutral', which no training"):
        assert main(["train", *TINY, *flags]) == 0


STUDY_CELL = Path(__file__).resolve().parents[1] / "results" / "smollm2-study" / "cb" / "capt" / "results.json"


def _damage(cell: dict, how: str):
    if how == "not json":
        return "{not json"
    if how == "a list":
        return []
    if how == "no task":
        return {k: v for k, v in cell.items() if k != "task"}
    if how == "no grid":
        return {k: v for k, v in cell.items() if k != "grid"}
    return {**cell, "score": "high"}  # a wrong type


@pytest.mark.parametrize("how", ["not json", "a list", "no task", "no grid", "a wrong type"])
def test_every_read_back_error_of_a_damaged_sweep_cell_names_its_file(how, tmp_path, capsys):
    """A finished cell's results.json damaged by hand, then read back by `sweep --finished-only`; and a grid
    point's results.json damaged while its cell is unfinished, read back for the progress line."""
    good = json.loads(STUDY_CELL.read_text())
    cell = tmp_path / "cb" / "capt" / "results.json"
    cell.parent.mkdir(parents=True)
    damaged = _damage(good, how)
    cell.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    argv = ["sweep", "--tasks", "cb", "--methods", "capt", "--output-dir", str(tmp_path), "--finished-only",
            "--data-dir", str(DATA)]  # fmt: skip
    err = _error(capsys, argv)
    assert err.splitlines()[-1].startswith(f"capt sweep: error: {cell} is damaged"), err

    cell.unlink()
    point = cell.parent / "grid" / "lr-0.01" / "results.json"
    point.parent.mkdir(parents=True)
    run = {k: v for k, v in good.items() if k not in ("chosen_lr", "grid", "epochs_to_best", "seconds_to_best")}
    if how in ("no task", "no grid"):  # what the progress line reads of a grid point: its time
        damaged = {k: v for k, v in run.items() if k != "wall_time_s"}
    elif how == "a wrong type":
        damaged = {**run, "wall_time_s": "slow"}
    else:
        damaged = _damage(run, how)
    point.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    err = _error(capsys, argv)
    assert err.splitlines()[-1].startswith(f"capt sweep: error: {point} is damaged"), err


def test_a_finished_run_without_its_weights_tabulates_but_every_command_that_needs_them_names_the_file(
    tmp_path, capsys
):
    """Scores come from results.json (a study is committed without weights, and `sweep --finished-only` still
    tabulates it: tests/test_decoder_pipeline.py); eval, predict and serve need the weights and name what is gone."""
    run = tmp_path / "cb"
    assert main(["train", *TINY, "--data-dir", str(DATA), "--output-dir", str(run)]) == 0
    capsys.readouterr()
    (run / "trainable.safetensors").unlink()
    for file in (run / "adapter").iterdir():
        file.unlink()
    (run / "adapter").rmdir()
    gone = "the run finished (its scores are in results.json) but its weights are gone"
    err = _error(capsys, ["eval", "--adapter", str(run), "--data-dir", str(DATA)])
    assert f"no trainable.safetensors in {run}: {gone}" in err, err
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({**json.loads((DATA / "CB" / "val.jsonl").read_text().splitlines()[0]), "task": "cb"}))
    output = str(tmp_path / "predictions.jsonl")
    err = _error(capsys, ["predict", "--adapters", f"cb={run}", "--input", str(source), "--output", output])
    assert f"no adapter in {run}: {gone}" in err, err
    with socket.socket() as probe:  # a free port: the adapter is what is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    err = _error(capsys, ["serve", "--model", "tiny-llama", "--adapters", f"cb={run}", "--port", str(port)])
    assert f"no adapter in {run}: {gone}" in err, err


def test_a_full_disk_while_the_learning_curves_are_drawn_names_the_file_and_resume_finishes(
    tmp_path, capsys, monkeypatch
):
    """The PNG's write fails with ENOSPC (the last file a run writes): the error names it, the run stays
    resumable, a plain rerun says --resume, and --resume finishes it with nothing stale left."""
    import errno

    import matplotlib.figure

    from capt.recipes import reporting

    run = tmp_path / "cb"
    argv = ["train", *TINY, "--data-dir", str(DATA), "--output-dir", str(run)]
    real_savefig = matplotlib.figure.Figure.savefig

    def full_disk(self, target, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    err = _error(capsys, argv)
    assert f"could not write {run / reporting.CURVES_PNG} (" in err and "No space left on device" in err
    assert "--resume" in err and (run / "checkpoint.pt").exists() and not (run / reporting.CURVES_PNG).exists()
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", real_savefig)
    assert "pass --resume" in _error(capsys, argv)
    assert main([*argv, "--resume"]) == 0
    assert (run / reporting.CURVES_PNG).stat().st_size > 0 and not (run / "checkpoint.pt").exists()
    assert not list(run.glob(".*.tmp"))


class Killed(BaseException):
    """Stands for SIGKILL in-process: no `except Exception` catches it, nothing after it runs."""


def test_resume_with_more_seeds_continues_a_killed_one_seed_run(tmp_path, capsys, monkeypatch):
    """A one-seed run killed after two checkpoints, then `--resume --seeds 2`: seed 0 continues from that
    checkpoint (not trained again), seed 1 is trained, and no stale checkpoint.pt is left anywhere."""
    from capt.recipes import experiments, train

    run = tmp_path / "cb"
    argv = ["train", *TINY, "--data-dir", str(DATA), "--output-dir", str(run), "--epochs", "2", "--batch-size", "4"]
    argv += ["--checkpoint-every", "2"]
    checkpoints = []

    def kill_at_the_third_checkpoint(name):
        checkpoints.append(name) if name == "checkpoint" else None
        if checkpoints.count("checkpoint") == 3:
            raise Killed

    monkeypatch.setattr(train, "pause_point", kill_at_the_third_checkpoint)
    with pytest.raises(Killed):
        main(argv)
    assert (run / "checkpoint.pt").exists() and not (run / "results.json").exists()
    monkeypatch.setattr(train, "pause_point", lambda name: None)

    calls = []
    real_train = experiments.train
    monkeypatch.setattr(
        experiments, "train", lambda c, resume=False: calls.append((c.seed, resume)) or real_train(c, resume)
    )
    assert main([*argv, "--seeds", "2", "--resume"]) == 0
    assert calls == [(0, True), (1, False)]
    assert not list(run.rglob("checkpoint.pt"))
    assert len(json.loads((run / "results.json").read_text())["runs"]) == 2
    steps = [json.loads(line) for line in (run / "seed-0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(1, 9))  # continued, not restarted
    calls.clear()
    assert main([*argv, "--seeds", "2", "--resume"]) == 0 and calls == []  # finished: read back
