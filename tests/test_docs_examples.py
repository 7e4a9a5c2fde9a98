"""Every ```python and ```bash block of README.md and docs/*.md runs, or says why not.

A block runs unless the line directly above its fence is `<!-- not run: REASON -->` (a GPU, a long run, a server
that stays up). The blocks of one page run in order in one temporary folder, as a reader would paste them: Python
blocks share one namespace, shell blocks see the files the earlier blocks wrote. Tiny models and data the blocks
make themselves keep this fast; the SuperGLUE files come from the shared folder through CAPT_DATA_DIR.

Fences are found with markdown-it-py, a CommonMark parser (the one behind mkdocs' own tooling and rich), so a
fence inside a list, or a line of backticks inside a block, is read as Markdown readers read it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data" / "superglue"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*?) -->$")
LANGUAGES = ("python", "bash")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    source: str
    not_run_reason: str | None


def blocks(path: Path) -> list[Block]:
    """The python and bash blocks of a Markdown file, with the not-run reason written above each, if any."""
    lines = path.read_text().splitlines()
    found = []
    for token in MarkdownIt("commonmark").parse("\n".join(lines)):
        language = token.info.split()[0] if token.info else ""
        if token.type != "fence" or language not in LANGUAGES:
            continue
        start = token.map[0]
        above = lines[start - 1].strip() if start > 0 else ""
        marker = NOT_RUN.match(above)
        found.append(Block(path, start + 1, language, token.content, marker["reason"] if marker else None))
    return found


def run_blocks(page_blocks: list[Block], folder: Path, env: dict[str, str]) -> None:
    """Run the blocks not marked as not run, in order, in `folder`; the first failure names its file and line."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    previous = Path.cwd()
    os.chdir(folder)
    try:
        for block in page_blocks:
            if block.not_run_reason is not None:
                continue
            where = f"{block.path.name}:{block.line}"
            if block.language == "python":
                try:
                    exec(compile(block.source, where, "exec"), namespace)
                except Exception as err:
                    raise AssertionError(f"the python block at {where} failed: {type(err).__name__}: {err}") from err
            else:
                done = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", block.source], env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    raise AssertionError(f"the bash block at {where} exited {done.returncode}:\n{done.stderr[-3000:]}")
    finally:
        os.chdir(previous)


def reader_env() -> dict[str, str]:
    """A shell as the docs assume it: `capt` and `python` of this environment first on PATH, offline, the data."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CAPT_DATA_DIR": str(DATA)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_block_of_the_page_runs_or_says_why_not(page, tmp_path, monkeypatch):
    page_blocks = blocks(page)
    env = reader_env()
    for key in ("HF_HUB_OFFLINE", "CAPT_DATA_DIR", "PYTHONPATH", "PATH"):
        monkeypatch.setenv(key, env[key])
    run_blocks(page_blocks, tmp_path, env)


def test_the_marker_must_sit_directly_above_the_fence_and_a_failing_block_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- not run: needs a GPU -->\n```bash\nexit 3\n```\n\n"
        "<!-- not run: too far above -->\n\n```python\nraise RuntimeError('ran')\n```\n"
        "- in a list:\n\n  ```bash\n  echo listed > listed.txt\n  ```\n"
    )
    found = blocks(page)
    assert [(b.line, b.language, b.not_run_reason) for b in found] == [
        (4, "bash", "needs a GPU"),
        (10, "python", None),  # a blank line between marker and fence: the marker does not count
        (15, "bash", None),
    ]
    with pytest.raises(AssertionError, match=r"the python block at page.md:10 failed: RuntimeError: ran"):
        run_blocks(found, tmp_path, reader_env())
    run_blocks([found[0], found[2]], tmp_path, reader_env())  # the marked `exit 3` is skipped
    assert (tmp_path / "listed.txt").read_text() == "listed\n"
    with pytest.raises(AssertionError, match=r"the bash block at page.md:4 exited 3"):
        run_blocks([Block(page, 4, "bash", "exit 3\n", None)], tmp_path, reader_env())
