"""The logits a Hugging Face `transformers` causal LM defines, from its last hidden state and
its LM head: `head_transform(config)`.

A `…ForCausalLM` forward computes `lm_head(hidden)` and then, for some architectures, turns
it into its logits: Granite divides by `logits_scaling`, Cohere multiplies by `logit_scale`,
Gemma 2/3 (and others) soft-cap with `final_logit_softcapping` (`c · tanh(x / c)`). Whoever
computes a loss from the hidden states and the head — the TRL trainer, the `model=hf`
adapter, fused or not — applies the same transform, or the loss sees a distribution the
model does not define. `head_transform` reads it from the config by the architecture's rule
(`HEAD_RULES`); an architecture whose logits come from a transform no rule describes is
refused by name. The rules are tested against `model(...).logits` itself.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch

from compiled_loss.vocab import LinearLogits

Tensor = torch.Tensor

# model_type (of the text config) → (config attribute, what the causal LM does with it); read
# off each architecture's `…ForCausalLM.forward` in transformers 5.25
_GRANITE = ("logits_scaling", "divide")
_COHERE = ("logit_scale", "multiply")
_GEMMA = ("final_logit_softcapping", "softcap")
HEAD_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "minicpm3"),
        (_GRANITE,),  # minicpm3 divides the hidden states by logits_scaling before the head: the same
    ),
    "hyperclovax": (("logits_scaling", "multiply"),),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), (_COHERE,)),
    **dict.fromkeys(
        (
            "gemma2",
            "gemma3",
            "gemma3_text",
            "gemma3n",
            "gemma3n_text",
            "gemma4",
            "gemma4_text",
            "gemma4_unified_text",
            "vaultgemma",
            "nanochat",
            "beam",
            "mistral_large4",
        ),
        (_GEMMA,),
    ),
}
"""The architectures whose logits are a transform of `lm_head(hidden)`, and the transform."""

REFUSED_HEADS = {
    "falcon_h1": "multiplies the head's output by lm_head_multiplier and more",
    "inkling_text": "divides the logits by logits_mup_width_multiplier",
    "recurrent_gemma": "soft-caps the logits with logits_soft_cap",
    "xlstm": "soft-caps the logits with output_logit_soft_cap",
}
"""`model_type` → what its `…ForCausalLM` does to `lm_head(hidden)` that `HeadTransform` does not describe."""

# An architecture outside HEAD_RULES whose config sets one of these is refused: its forward may
# transform the logits in a way no rule here describes
_TRANSFORM_ATTRIBUTE = re.compile(r"logits?_(scal|soft_?cap|mup)|final_logit|lm_head_multiplier|output_logit")


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """`logits = softcap · tanh(scale · lm_head(hidden) / softcap)` (no tanh without a softcap)."""

    scale: float = 1.0
    softcap: float | None = None

    def dense(self, logits: Tensor) -> Tensor:
        """The model's logits from `lm_head`'s output (in its dtype, as the model computes them)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def linear(self, hidden: Tensor, weight: Tensor, bias: Tensor | None = None) -> LinearLogits:
        """The model's logits as `LinearLogits` (the scale folded into the hidden states and the
        bias, the softcap applied inside each chunk of the fused head)."""
        if self.scale != 1.0:
            hidden = hidden * self.scale
            bias = None if bias is None else bias * self.scale
        return LinearLogits(hidden, weight, bias, softcap=self.softcap)


def head_transform(config: Any) -> HeadTransform:
    """The transform a `transformers` config's architecture applies to its causal LM's logits
    (the text config's, for a multimodal one), by `HEAD_RULES`. A ValueError names an
    architecture in `REFUSED_HEADS`, one outside the rules whose config sets a transform-like
    attribute (`logits_scaling`, `logit_scale`, `final_logit_softcapping`, …), or a factor
    that is not a finite number > 0."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    refused = REFUSED_HEADS.get(model_type) or REFUSED_HEADS.get(getattr(config, "model_type", None))
    if refused is None and model_type not in HEAD_RULES:
        found = sorted(
            f"{name}={value!r}"
            for name, value in vars(text).items()
            if _TRANSFORM_ATTRIBUTE.search(name) and value not in (None, False, 1, 1.0, 0, 0.0)
        )
        refused = f"sets {', '.join(found)}, which no rule here describes" if found else None
    if refused is not None:
        raise ValueError(
            f"model_type={model_type!r}: its logits are not lm_head(hidden) up to a scale and a softcap (it "
            f"{refused}); compiled_loss computes the loss from the hidden states and the LM head, so it cannot "
            "give this model's own logits"
        )
    scale, softcap = 1.0, None
    for name, action in HEAD_RULES.get(model_type, ()):
        value = getattr(text, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"model_type={model_type!r}: config.{name}={value!r} must be a finite number > 0 or None")
        if action == "softcap":
            softcap = float(value)
        else:
            scale *= 1.0 / value if action == "divide" else float(value)
    return HeadTransform(scale, softcap)
