#!/usr/bin/env bash
# The two committed "your own data" runs on SmolLM2-135M-Instruct (results/your-data/README.md), one after the
# other, on one thread each (OMP_NUM_THREADS=1). Run from the repository root.
set -euo pipefail
python results/your-data/build_data.py ../shared/data/superglue runs/your-data
mkdir -p results/your-data/logs
# (b) CaPT on a `messages` jsonl (RTE as chat, answered yes or no): a generate task read from its task file.
capt train --task runs/your-data/rte-chat/task.yaml \
  --model smollm2 --lr 0.09 --batch-size 8 --eval-batch-size 16 --max-length 192 --epochs 2 \
  --output-dir results/your-data/runs/rte-chat --overwrite 2>&1 | tee results/your-data/logs/rte-chat.live.log
# (a) CaPT on a CSV of sentence pairs (CB, columns renamed); test = CB's official validation split.
capt train --train-file runs/your-data/cb-pairs/train.csv --test-file runs/your-data/cb-pairs/test.csv \
  --text-fields sentence1,sentence2 --label-field verdict --task-name cb-pairs \
  --model smollm2 --lr 0.09 --batch-size 8 --eval-batch-size 16 --max-length 160 --epochs 2 \
  --output-dir results/your-data/runs/cb-pairs --overwrite 2>&1 | tee results/your-data/logs/cb-pairs.live.log
