"""What the co-trained drafters (`eagle3`, `dflash`) share: the denominator epsilons of
their reference losses (one place, named by the reference quantity each is), shifts that
stay inside one document, the rotary position embedding, and the checks of their configs,
builders and batches."""

from __future__ import annotations

from typing import Any

import torch

from compiled_loss.checks import check_factor, check_fields, require
from compiled_loss.draft.runtime import DraftBatch, aux_layers_default
from compiled_loss.vocab import DraftVocab

Tensor = torch.Tensor

EAGLE3_LOSS_DEN_EPS = 1e-5
"""EAGLE3 TTT (ref §11.3): `loss_den_k = Σ mask + 1e-5`, each TTT step's denominator, added
before the data-parallel all-reduce."""
DFLASH_LOSS_DEN_EPS = 1e-6
"""DSpark / DFlash (ref §11.3, `compute_dspark_loss`): the `+1e-6` on the loss denominators
(`Σ w`, `Σ eval`) all-reduced over the data-parallel group."""

ROPE_THETA = 10000.0
"""The drafters' default base of the rotary position embedding (Llama's `rope_theta`)."""

_NO_DOCUMENT = -2  # fill of shifted document ids: equals no document (and not padding's -1)


# ---------------------------------------------------------------------------------------
# Shifts inside one document
# ---------------------------------------------------------------------------------------


def shift_left(x: Tensor, offset: int, fill: float | int) -> Tensor:
    """`x[:, t + offset]` at slot t along dim 1, `fill` past the end (static shape)."""
    length = x.shape[1]
    if offset >= length:
        return torch.full_like(x, fill)
    tail = torch.full((x.shape[0], offset, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, offset:], tail], 1)


def same_document(document_ids: Tensor, offset: int) -> Tensor:
    """`[R, L]` bool: slot `t + offset` exists in the row and belongs to slot t's document
    (never for a padding slot). Documents are contiguous, so every slot in between does too."""
    return (shift_left(document_ids, offset, _NO_DOCUMENT) == document_ids) & (document_ids >= 0)


# ---------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------


def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin `[..., d/2]` of the angles `positions · inv_freq` (`inv_freq [d/2]`), computed
    in `inv_freq`'s dtype (at least float32), then cast to `dtype`. Each drafter keeps its own
    `inv_freq` formula: `θ^(-2i/d)` (EAGLE-3) and `1 / θ^(2i/d)` (DFlash, Hugging Face's)
    round differently in the last bit, and trained numbers depend on it."""
    work = torch.promote_types(inv_freq.dtype, torch.float32)
    angles = positions.to(work)[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half (Llama / Hugging Face) convention: feature i pairs with
    feature i + d/2 of `x [..., d]`, rotated by `cos, sin` broadcast to `[..., d/2]`."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


def check_draft_config(config: Any, sizes: tuple[str, ...]) -> None:
    """The checks of the fields every draft config has (in `__post_init__`): each field's
    type; `aux_layers` (a Hydra list becomes a tuple) None or distinct layer indices >= 0;
    `loss_weight` >= 0 within the factor range; the `sizes` fields None or >= 1; and
    `hidden_size` into `num_heads` heads of an even width when both are set."""
    if isinstance(config.aux_layers, list):  # a Hydra / YAML list
        object.__setattr__(config, "aux_layers", tuple(config.aux_layers))
    check_fields(config)
    require(config.loss_weight >= 0, f"loss_weight must be >= 0, got {config.loss_weight}")
    check_factor("loss_weight", config.loss_weight, "it scales the draft loss")
    for name in sizes:
        value = getattr(config, name)
        require(value is None or value >= 1, f"{name} must be None or >= 1, got {value}")
    layers = config.aux_layers
    require(
        layers is None
        or (
            isinstance(layers, tuple)
            and len(layers) > 0
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
            and len(set(layers)) == len(layers)
        ),
        f"aux_layers must be None or a non-empty tuple of distinct layer indices >= 0, got {layers!r}",
    )
    if config.hidden_size is not None and config.num_heads is not None:
        check_heads(config.hidden_size, config.num_heads)


def check_heads(hidden_size: int, num_heads: int) -> None:
    """ConfigError unless `hidden_size` splits into `num_heads` heads of an even width (RoPE
    rotates feature pairs)."""
    require(
        hidden_size % num_heads == 0 and (hidden_size // num_heads) % 2 == 0,
        f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) into an even head size",
    )


def resolve_aux_layers(aux_layers: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    """The policy decoder layers a drafter reads, ascending (None: `aux_layers_default`);
    ConfigError unless each is a layer of a policy of `num_layers` decoder layers."""
    layers = aux_layers_default(num_layers) if aux_layers is None else tuple(sorted(aux_layers))
    require(
        all(i < num_layers for i in layers),
        f"aux_layers {layers} must name decoder layers of the policy, [0, {num_layers})",
    )
    return layers


def resolve_draft_vocab(
    d2t: Tensor | DraftVocab | None, draft_vocab_size: int | None, vocab_size: int
) -> DraftVocab | None:
    """The draft vocabulary `d2t` maps (draft id i → target id i + d2t[i]; None: the policy's
    own), checked once against the policy's `vocab_size` and the config's `draft_vocab_size`
    (None: whatever `d2t` gives)."""
    if d2t is None:
        require(
            draft_vocab_size in (None, vocab_size),
            f"draft_vocab_size ({draft_vocab_size}) differs from the policy's vocabulary ({vocab_size}): "
            "pass a d2t map",
        )
        return None
    vocab = d2t if isinstance(d2t, DraftVocab) else DraftVocab.build(d2t)
    require(
        draft_vocab_size in (None, vocab.size),
        f"draft_vocab_size ({draft_vocab_size}) must equal the size of the d2t map ({vocab.size})",
    )
    vocab.check_vocab(vocab_size)
    return vocab


def check_draft_batch(
    batch: DraftBatch, n_slots: int, aux_hidden_size: int, vocab_size: int, anchor_noise: bool = False
) -> None:
    """ValueError unless `n_slots` is an int >= 1 and the batch's tensors have the shapes a
    drafter reading `aux_hidden_size` hidden features and a `vocab_size` teacher expects
    (`anchor_noise`: it reads the anchor noise too). Static shapes: free under compile."""
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise ValueError(f"n_slots must be an int >= 1, got {n_slots!r}")
    ids = batch.input_ids
    if ids.dim() != 2:
        raise ValueError(f"DraftBatch.input_ids must be [R, L], got shape {tuple(ids.shape)}")
    rows, length = ids.shape
    expected = {
        "hidden_states": (rows, length, aux_hidden_size),
        "teacher_logits": (rows, length, vocab_size),
        "loss_mask": (rows, length),
        "document_ids": (rows, length),
        "position_ids": (rows, length),
    }
    if anchor_noise:
        expected["anchor_noise"] = (rows, length)
    for name, shape in expected.items():
        value = getattr(batch, name)
        got = None if value is None else tuple(value.shape)
        if got != shape:
            raise ValueError(f"DraftBatch.{name} must have shape {shape}, got {got}")
