"""One SmolLM2-135M training step (forward + backward, every weight trainable, batch 8 x 32 tokens) in float32 and
under bf16 autocast, alternating, on one torch thread: whether `--bf16` pays off on this CPU.

    HF_HUB_OFFLINE=1 python benchmarks/bf16_cpu.py

On an AVX2-only AMD EPYC (no oneDNN bf16) it printed fp32 5.12, bf16 56.38, fp32 3.31, bf16 60.45 CPU seconds
(results/precision-check/README.md): bf16 about 18x slower once warm.
"""

import time

import torch

from capt.recipes.backbones import load_backbone

torch.set_num_threads(1)
model = load_backbone("smollm2").model
ids = torch.randint(0, 1000, (8, 32))


def step(bf16: bool) -> float:
    started = time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return time.process_time() - started


print(
    "oneDNN bf16:",
    torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    "| cpu capability:",
    torch.backends.cpu.get_cpu_capability(),
)
for bf16 in (False, True, False, True):
    print("bf16" if bf16 else "fp32", round(step(bf16), 2), "s", flush=True)
