"""`capt lm-eval`: lm-evaluation-harness on a CaPT run scores log-likelihoods exactly as `capt eval` does.

The task is a local COPA-like YAML over the shared COPA file (lm-eval's own tasks download from the Hub), written
to give the same context and continuation strings as capt's COPA template, so the tokens are the same.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from capt.import_utils import missing_modules
from capt.recipes.cli import main
from capt.recipes.evaluate import load_splits
from capt.recipes.run import ADAPTER_DIR, load_run

needs_lm_eval = pytest.mark.skipif(bool(missing_modules("lm_eval")), reason="the lm-eval extra is not installed")
if not missing_modules("lm_eval"):
    from lm_eval.api.instance import Instance

    from capt.recipes.lm_eval import CaptLM, load_adapter_model

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
EXAMPLES = 8
# The MiniLM tokenizer of tiny-llama wraps text in [CLS] ... [SEP] when asked for special tokens and has neither a
# BOS nor an EOS: lm-eval is told to add none and to use [SEP] (the tiny model's BOS id) for an empty context.
TINY_MODEL_ARGS = "add_bos_token=False,prefix_token_id=102"


@pytest.fixture(scope="module")
def copa_run(tmp_path_factory) -> Path:
    """A CaPT run of tiny-llama on COPA, trained one epoch with a high rate so its capsules are far from zero."""
    root = tmp_path_factory.mktemp("copa")
    argv = ["train", "--model", "tiny-llama", "--task", "copa", "--epochs", "1", "--lr", "2", "--batch-size", "4"]
    argv += ["--limit-train", "16", "--limit-eval", str(EXAMPLES), "--data-dir", str(DATA)]
    assert main([*argv, "--output-dir", str(root / "run"), "--cache-dir", str(root / "cache")]) == 0
    return root / "run"


def _copa_task(folder: Path) -> Path:
    """lm-eval's COPA prompt (premise without its full stop + because/therefore) with one space before each
    lower-cased choice, as capt writes it (lm-eval's own COPA task puts two)."""
    folder.mkdir()
    (folder / "copa_local.yaml").write_text(
        textwrap.dedent(f"""\
            task: copa_local
            dataset_path: json
            dataset_kwargs:
              data_files:
                validation: {DATA / "COPA" / "val.jsonl"}
            validation_split: validation
            output_type: multiple_choice
            doc_to_text: "{{{{ premise[:-1] }}}} {{{{ 'because' if question == 'cause' else 'therefore' }}}}"
            doc_to_choice: "{{{{ [choice1[0] | lower ~ choice1[1:], choice2[0] | lower ~ choice2[1:]] }}}}"
            doc_to_target: label
            metric_list:
              - metric: acc
                aggregation: mean
                higher_is_better: true
            """)
    )
    return folder


def _capt_eval_scores(run: Path) -> tuple[list[list[list[int]]], torch.Tensor]:
    """Each example's option rows (token ids) and option scores, from the code `capt eval` runs."""
    config, model, fmt = load_run(run)
    examples = load_splits(config)["test"]
    features = [fmt.encode(example) for example in examples]
    with torch.no_grad():
        scores = fmt.scores(model.eval(), fmt.collate(features))
    return [[row["input_ids"] for row in f["rows"]] for f in features], scores


@needs_lm_eval
def test_lm_eval_scores_equal_capt_eval_on_the_same_tokens(copa_run, tmp_path, capsys, monkeypatch):
    # lm-eval's CLI would bind its log handler to this test's captured stderr, which later tests find closed.
    monkeypatch.setattr("lm_eval.utils._LOGGING_CONFIGURED", True)
    tasks, out = _copa_task(tmp_path / "tasks"), tmp_path / "out"
    argv = ["lm-eval", "--model", "capt", "--model_args", f"adapter={copa_run},{TINY_MODEL_ARGS}", "--device", "cpu"]
    argv += ["--tasks", "copa_local", "--include_path", str(tasks), "--limit", str(EXAMPLES)]
    assert main([*argv, "--log_samples", "--output_path", str(out), "--batch_size", "3"]) == 0
    samples = [json.loads(line) for line in next(out.rglob("samples_copa_local_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    harness = torch.tensor([[float(ll) for ll, _ in s["filtered_resps"]] for s in samples])

    rows, capt_scores = _capt_eval_scores(copa_run)
    tokenizer = load_adapter_model(str(copa_run))[1]
    for sample, options in zip(samples, rows, strict=True):  # the same tokens: context + continuation
        pairs = [sample["arguments"][f"gen_args_{i}"] for i in range(len(options))]
        assert [tokenizer(p["arg_0"] + p["arg_1"], add_special_tokens=False)["input_ids"] for p in pairs] == options
    assert len(samples) == EXAMPLES
    torch.testing.assert_close(harness, capt_scores, atol=1e-4, rtol=0)

    # And the same accuracy as `capt eval` on those examples.
    assert main(["eval", "--adapter", str(copa_run)]) == 0
    capt_accuracy = json.loads((copa_run / "eval-copa-test.json").read_text())["accuracy"]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["copa_local"]
    assert results["acc,none"] == pytest.approx(capt_accuracy)
    assert "copa_local" in capsys.readouterr().out  # lm-eval's table


@needs_lm_eval
def test_the_continuation_stays_out_of_the_capsule_mean(copa_run):
    """The whole-row protocol (lm-eval's `hf` model: every token an instance token) scores differently, by more
    than ten times the tolerance of the equality above, which so holds only because the continuation is a target.
    (A random tiny model moves little with its capsule; SmolLM2 moves by nats.)"""
    model, tokenizer = load_adapter_model(str(copa_run))
    lm = CaptLM(adapter=str(copa_run), device="cpu", add_bos_token=False, prefix_token_id=102)
    context, continuation = "The man turned on the faucet therefore", " water flowed from the spout."
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    ((logprob, _),) = lm.loglikelihood([request])

    ids = tokenizer(context + continuation, add_special_tokens=False, return_tensors="pt")["input_ids"]
    split = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.log_softmax(-1)[0, split - 1 : -1]
    whole_row = logits.gather(-1, ids[0, split:, None]).sum().item()
    with torch.no_grad():
        logits = model(input_ids=ids, instance_mask=torch.arange(ids.shape[1])[None] < split).logits
    context_only = logits.log_softmax(-1)[0, split - 1 : -1].gather(-1, ids[0, split:, None]).sum().item()
    assert logprob == pytest.approx(context_only, abs=1e-4)
    assert abs(whole_row - context_only) > 1e-3


@needs_lm_eval
def test_an_adapter_folder_with_its_backbone_scores_like_its_run(copa_run):
    request = Instance("loglikelihood", {}, ("The girl found a bug in her cereal therefore", " she lost it."), 0)
    args = dict(device="cpu", add_bos_token=False, prefix_token_id=102)
    from_run = CaptLM(adapter=str(copa_run), **args).loglikelihood([request])
    from_adapter = CaptLM(adapter=str(copa_run / ADAPTER_DIR), pretrained="tiny-llama", **args).loglikelihood([request])
    assert from_adapter[0][0] == pytest.approx(from_run[0][0], abs=1e-5)


@needs_lm_eval
def test_bad_adapter_arguments_say_what_is_wrong(copa_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a `capt train` run folder"):
        load_adapter_model(str(tmp_path))
    with pytest.raises(ValueError, match="is a run folder: it names its backbone itself"):
        load_adapter_model(str(copa_run), pretrained="tiny-llama")
    with pytest.raises(ValueError, match="takes a number for --batch_size"):
        CaptLM(adapter=str(copa_run), batch_size="auto")
    with pytest.raises(ValueError, match="add prefix_token_id=ID"):  # tiny-llama's tokenizer has no BOS or EOS
        CaptLM(adapter=str(copa_run), device="cpu")


def test_without_the_extra_the_command_names_it(monkeypatch, capsys):
    monkeypatch.setattr("capt.import_utils.missing_modules", lambda *names: list(names))
    assert main(["lm-eval", "--model", "capt", "--tasks", "copa"]) == 1
    expected = 'capt lm-eval needs the [lm-eval] extra (lm_eval missing): pip install "capt[lm-eval]"'
    assert expected in capsys.readouterr().err
