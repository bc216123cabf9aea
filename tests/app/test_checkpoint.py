"""Checkpoints: a run resumed from `run.save_every`'s checkpoint — in the warm start or in
the loss's steps, with a co-trained drafter too — continues with the uninterrupted run's
metrics and ends with its weights (fp32, eager: bitwise); a checkpoint of another loss
or a missing file is refused naming `run.resume`."""

from __future__ import annotations

import json

import pytest
import torch

from compiled_loss.app import compose_config
from compiled_loss.demo.loop import train

SMALL = [
    "model.vocab_size=32", "model.hidden_size=32", "model.num_heads=2", "model.max_positions=64",
    "data.modulus=16", "data.prompt_terms_max=5", "data.response_max=12", "data.total_terms=10",
    "data.prompts=4", "data.group_size=4", "compile.enabled=false", "run.sft_steps=3", "run.steps=4",
    "run.save_every=2",
]
TIMING = {"sample_seconds", "step_seconds", "tokens_per_s"}


def _run(out, *overrides: str) -> list[dict]:
    train(compose_config(*SMALL, *overrides), out)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("draft", ["none", "dflash"])
def test_a_resumed_run_continues_as_the_uninterrupted_one(draft, tmp_path):
    whole = _run(tmp_path / "whole", f"draft={draft}")
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == [
        "step_2.pt", "step_4.pt", "step_6.pt", "step_7.pt"]
    final = torch.load(tmp_path / "whole" / "checkpoints" / "step_7.pt", weights_only=True)
    for at in (2, 4):  # in the warm start (the reference is still to be set), in the loss's steps
        resumed = _run(tmp_path / f"from{at}", f"draft={draft}",
                       f"run.resume={tmp_path / 'whole' / 'checkpoints' / f'step_{at}.pt'}")
        assert [r["step"] for r in resumed] == list(range(1, 8))
        for got, want in zip(resumed, whole):
            assert {k: v for k, v in got.items() if k not in TIMING} == {
                k: v for k, v in want.items() if k not in TIMING}, got["step"]
        ended = torch.load(tmp_path / f"from{at}" / "checkpoints" / "step_7.pt", weights_only=True)
        for part in ("policy", "reference", "drafter"):
            for key, value in (final[part] or {}).items():
                assert torch.equal(ended[part][key], value), (at, part, key)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    _run(tmp_path / "whole", "run.steps=1")
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2.pt"
    with pytest.raises(ValueError, match=r"run.resume=.*step_2.pt' was written by a loss=clipped_pg run; this run "
                                         r"has loss=gspo"):
        _run(tmp_path / "gspo", "loss=gspo", f"run.resume={checkpoint}")
    with pytest.raises(ValueError, match=r"run.resume=.*nothing.pt': no such checkpoint file"):
        _run(tmp_path / "missing", f"run.resume={tmp_path / 'nothing.pt'}")
