"""The package stands alone: the wheel carries the licence and the configs, installs into a fresh environment and
runs from outside the checkout; `--config` takes a shipped config's name; a missing backbone package is one line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from capt.recipes import cli, gguf

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "superglue"


def test_config_takes_a_shipped_name_or_a_path_and_a_local_file_wins(tmp_path, monkeypatch):
    assert {"minilm", "smollm2-study", "t5-base"} <= set(cli.shipped_configs())
    assert cli.resolve_config("minilm") == cli.SHIPPED_CONFIGS / "minilm.yaml"
    assert cli._read_yaml("smollm2-study")["model"] == "smollm2"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "minilm").write_text("epochs: 2\n")  # a file of that name in the working folder is what it means
    assert cli._read_yaml("minilm") == {"epochs": 2}
    with pytest.raises(ValueError, match=r"--config nonesuch: no such file, and no shipped config .*minilm"):
        cli.resolve_config("nonesuch")
    with pytest.raises(ValueError, match="--config configs/nonesuch.yaml: no such file"):
        cli._read_yaml("configs/nonesuch.yaml")  # a path is never looked up among the shipped names


def test_a_missing_backbone_package_is_one_line_with_the_install_line(tmp_path, monkeypatch, capsys):
    spec = dataclasses.replace(gguf.GGUF_BACKBONES["smollm2"], package="capt_no_such_gguf_package")
    monkeypatch.setitem(gguf.GGUF_BACKBONES, "smollm2", spec)
    argv = ["train", "--task", "cb", "--model", "smollm2", "--data-dir", str(DATA), "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("capt train: error: backbone 'smollm2' needs capt_no_such_gguf_package: run pip install")
    assert "internal error" not in err and len(err.splitlines()) == 1


def _outside_env() -> dict[str, str]:
    """The environment of a user outside the checkout: no PYTHONPATH into it, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _fresh_venv_with_the_wheel(tmp_path: Path) -> Path:
    """Build the wheel, install it into a new venv, and return that venv's bin folder.

    The new venv sees this interpreter's site-packages through a .pth file, appended after its own, so the
    heavy dependencies (torch, transformers) are not reinstalled. A path line in a .pth file is not a site
    folder: the .pth files inside it (the checkout's editable install) are not run, so `capt` resolves to the
    wheel's copy alone.
    """
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("capt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "capt/recipes/configs/smollm2-study.yaml" in names and "capt/recipes/configs/accelerate/ddp.yaml" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    fresh = venv / "bin" / "python"
    purelib = subprocess.run(
        [fresh, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True
    )
    # Installed before the .pth exists, so that pip sees an empty environment and never touches the outer one.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", fresh, "install", "--quiet", "--no-deps", "--ignore-installed"]
        + [wheel],
        check=True,
        env=_outside_env(),
    )
    site = Path(purelib.stdout.decode().strip())
    (site / "outer-site-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


@pytest.mark.skipif(not DATA.is_dir(), reason="needs the shared SuperGLUE files")
def test_the_wheel_installs_into_a_fresh_venv_and_runs_outside_the_checkout(tmp_path):
    bin_dir = _fresh_venv_with_the_wheel(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = _outside_env()

    def capt(*args: str) -> str:
        done = subprocess.run([bin_dir / "capt", *args], cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = subprocess.run(
        [bin_dir / "python", "-c", "import capt; print(capt.__file__)"], cwd=work, env=env, capture_output=True
    )
    assert where.stdout.decode().startswith(str(tmp_path / "venv")), where  # the wheel's copy, not the checkout
    assert "train" in capt("--help") and "sweep" in capt("--help")
    assert "shipped one (llama-3.2-1b, minilm" in " ".join(capt("train", "--help").split())
    imported = subprocess.run(
        [bin_dir / "python", "-X", "importtime", "-m", "capt.recipes.cli", "train", "--help"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    top_level = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in imported.splitlines()}
    assert "capt" in top_level and not top_level & {"torch", "transformers", "peft"}  # the help loads no torch
    capt(
        *("train", "--config", "minilm", "--task", "cb", "--epochs", "1", "--limit-train", "16"),
        *("--limit-eval", "8", "--max-length", "64", "--data-dir", str(DATA), "--output-dir", "run"),
    )
    assert (work / "run" / "results.json").is_file()
    assert not (work / "benchmarks").exists()


def test_the_long_description_has_no_relative_links():
    """README.md is the package's long description: on an index page a relative link is dead."""
    from markdown_it import MarkdownIt

    def targets(tokens):
        for token in tokens:
            if token.type in ("link_open", "image"):
                yield token.attrGet("href") or token.attrGet("src")
            yield from targets(token.children or [])

    found = list(targets(MarkdownIt("commonmark").parse((REPO / "README.md").read_text())))
    relative = [t for t in found if not t.startswith(("https://", "http://", "mailto:"))]
    assert relative == []


def test_no_tracked_file_passes_2_mb():
    """A clone stays small: weights, checkpoints and data stay out of git (a LoRA study checkpoint is 7.6 MB)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = [REPO / name for name in listed.stdout.decode().split("\0") if name]
    assert tracked
    too_large = [str(path.relative_to(REPO)) for path in tracked if path.is_file() and path.stat().st_size > 2**21]
    assert too_large == []
