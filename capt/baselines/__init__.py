"""Prompt-tuning baselines of the CaPT paper, built on the same slot machinery as CaPT (`capt.injector`).

Each prompt method is a *slot module*: called as `module(layer, hidden, weights)` it returns the (B, n, d) vectors
written at the front of a layer's input, exactly like `capt.capsule.Capsules`. Methods that prompt the input only
(DePT, LoPA, IDPG, SMoP, Residual Prompt Tuning) are written at the first layer and flow through the model; M-IDPG
and VFPT, like Deep Prompt-Tuning and CaPT, overwrite their slots at every layer. Options live in
`capt.baselines.options` (a leaf, read by `CaptConfig`), the modules in one small file per method, and
`capt.baselines.registry` builds them.
Bottleneck adapters (`capt.baselines.adapter`) act on sublayer outputs instead and use their own hooks.
"""
