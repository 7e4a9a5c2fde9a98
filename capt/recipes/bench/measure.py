"""Timing of training steps and `generate` calls, and peak memory of one training step.

Time: forward + backward + optimizer step, on two clocks. `wall` is elapsed time; `cpu` is the process's CPU
time, which leaves out the time the OS gives to other processes: with one torch thread (the default) it is the
step's own compute, the steadiest number a shared machine can give. With several threads it also counts
OpenMP threads spinning at barriers, so use the wall clock then. The methods of one (backbone, length) cell run
interleaved, one step each per round, in a rotating order, so load from other processes hits all of them
alike; each method's cost is then the median over rounds of its time divided by the floor's time *in the same
round* (a paired ratio, less noisy than a ratio of two medians).

Peak memory: CPU has no allocator high-water mark like `torch.cuda.max_memory_allocated`, and RSS is blurred by
the libc allocator and by the other models living in the same process. `torch.profiler` with
`profile_memory=True` instead reports every allocation and free of torch's CPU allocator; the running sum over
one step gives its peak above the step's start (activations kept for backward, gradients, temporaries). The
optimizer state held between steps is added, so the number is what training needs on top of the frozen
weights, which all methods share. It is exact and deterministic, whatever the load.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass
class TrainStep:
    """One method's training step on one batch; call it to run the step."""

    model: nn.Module
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    embed_inputs: bool = False  # the floor: gradients to the input embeddings instead of parameters

    def __post_init__(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4) if params else None

    def __call__(self) -> None:
        inputs = self.inputs
        if self.embed_inputs:
            ids = inputs["input_ids"]
            embeds = self.model.get_input_embeddings()(ids).detach().requires_grad_(True)
            inputs = {k: v for k, v in inputs.items() if k != "input_ids"} | {"inputs_embeds": embeds}
        self.model(**inputs).loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            # Gradients die here, not at the next step's start, so no step begins holding the last one's.
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        return sum(
            t.nbytes for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        )


def timed(fn: Callable[[], object]) -> dict[str, float]:
    """Wall-clock and CPU seconds of one call, with the garbage collector kept out of the measurement."""
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    finally:
        gc.enable()


def peak_bytes(step: TrainStep) -> int:
    """Optimizer state plus the peak of what one step allocates above its start (see the module docstring)."""
    state = step.optimizer_state_bytes()
    gc.collect()
    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Memory events carry the signed size of each allocation (+) and free (-); order them in time.
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return state + peak


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """libkineto writes log lines straight to file descriptor 2 at every profiler start and stop, whatever
    KINETO_LOG_LEVEL says; over a whole grid that buries the progress log."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def interleaved(calls: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, dict[str, list]]:
    """{name: {"wall": [...], "cpu": [...]}} seconds per call, over `repeats` rounds after `warmup` untimed ones.

    Each round runs every call once; the starting point rotates from round to round so no method is always
    first (cold caches) or always after the same neighbour.
    """
    names = list(calls)
    times: dict[str, dict[str, list]] = {name: {"wall": [], "cpu": []} for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = timed(calls[name])
            if round_index >= warmup:
                for clock, value in seconds.items():
                    times[name][clock].append(value)
    return times
