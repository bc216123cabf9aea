"""The vocab primitive's preconditions in eager mode: an id outside the vocabulary is
refused — never scored as `-lse` — whether the logits are a tensor or `LinearLogits`."""

from __future__ import annotations

import pytest
import torch

from compiled_loss.vocab import LinearLogits, token_logprobs, vocab_reduce

V, H = 6, 4


@pytest.mark.parametrize("bad", [V, -1, 1000])
@pytest.mark.parametrize("kind", ["logits", "linear"])
def test_an_id_outside_the_vocabulary_is_refused(kind, bad):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, H, generator=g), torch.randn(V, H, generator=g)
    logits = LinearLogits(h, w) if kind == "linear" else torch.nn.functional.linear(h, w)
    targets = torch.tensor([0, 5, bad, 2, bad])
    expected = f"vocab_reduce: index holds ids outside the vocabulary [0, {V}) (2 of 5)"
    with pytest.raises(ValueError) as error:
        token_logprobs(logits, targets)
    assert str(error.value) == expected
    with pytest.raises(ValueError) as error:
        vocab_reduce(logits, torch.stack([targets, targets.clamp(0, V - 1)], -1), entropy=True)
    assert str(error.value) == expected.replace("2 of 5", "2 of 10")
    assert token_logprobs(logits, targets.clamp(0, V - 1)).shape == (5,)  # in range: accepted
