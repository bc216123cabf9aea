"""The demo's cross-tokenizer teacher: the progression task spelled in decimal digits.

Both models read the same text: each value token in decimal followed by a space (`"17 "`;
any token past the special ones is read as the value `id - 3`, so sampled tokens beyond the
task's values have a text too), and PAD, BOS, EOS one character each. The student (the demo's
policy) has one token per value, its whole text; the teacher spells the text in finer
tokens — the digits `0`–`9`, the space and PAD/BOS/EOS, 14 tokens — so its rows are longer
and its positions differ. The student's
prediction at token `t` is matched with the teacher's at the space after value `t` (or at
BOS): both next tokens start the next value (`compiled_loss.inputs.align_tokenizations`).
There the teacher predicts a first digit, which the projection spreads evenly over the
values whose decimal starts with it; BOS, EOS and PAD map to themselves, and a teacher
token that starts no value (the space, a digit no value below `modulus` starts with)
spreads evenly over all values.

Each teacher is a frozen random-init `TinyLM` of the digit vocabulary; every teacher of
`loss.teacher_weights` gets its own. Teacher rows are padded to `teacher_width(cfg)`, a
width fixed by the config, so the teacher's logits never change the compiled shapes.
The run's batches get the teachers' logits from `compiled_loss.app.batches.annotate_cross_tokenizer`.
"""

from __future__ import annotations

import dataclasses

import torch

from compiled_loss.config import TASK_SPECIAL_TOKENS, Config, ModelConfig, build_loss
from compiled_loss.demo.model import TinyLM
from compiled_loss.inputs import align_tokenizations
from compiled_loss.losses import CrossTokenizerDistillationLossFn

Tensor = torch.Tensor

PAD, BOS, EOS = range(TASK_SPECIAL_TOKENS)  # the same ids in both vocabularies
FIRST_DIGIT = TASK_SPECIAL_TOKENS
SPACE = FIRST_DIGIT + 10
TEACHER_VOCAB_SIZE = SPACE + 1


def teacher_width(cfg: Config) -> int:
    """The longest teacher row: every token of the longest row spelled with the most digits
    a token id can take, and a space."""
    digits = len(str(cfg.model.vocab_size - 1 - TASK_SPECIAL_TOKENS))
    return cfg.data.max_length() * (digits + 1)


def teacher_model_config(cfg: Config) -> ModelConfig:
    """The policy's architecture over the digit vocabulary, with positions for its longer rows."""
    return dataclasses.replace(
        cfg.model, vocab_size=TEACHER_VOCAB_SIZE, max_positions=max(cfg.model.max_positions, teacher_width(cfg))
    )


def teacher_models(cfg: Config) -> list[TinyLM]:
    """One frozen random-init digit-vocabulary teacher per entry of `loss.teacher_weights`."""
    count = len(cfg.loss.teacher_weights)
    return [TinyLM(teacher_model_config(cfg)).requires_grad_(False).eval() for _ in range(count)]


def teacher_projection(modulus: int, student_vocab_size: int) -> Tensor:
    """`[TEACHER_VOCAB_SIZE, student_vocab_size]`: each teacher token over the student tokens
    its text can start (see the module docstring); rows sum to 1."""
    projection = torch.zeros(TEACHER_VOCAB_SIZE, student_vocab_size)
    for token in (PAD, BOS, EOS):
        projection[token, token] = 1.0
    values = torch.arange(modulus) + TASK_SPECIAL_TOKENS
    for digit in range(10):
        starts = [v for v in range(modulus) if str(v)[0] == str(digit)]
        targets = torch.tensor(starts) + TASK_SPECIAL_TOKENS if starts else values
        projection[FIRST_DIGIT + digit, targets] = 1.0 / len(targets)
    projection[SPACE, values] = 1.0 / modulus
    return projection


def build_cross_tokenizer_loss(cfg: Config) -> CrossTokenizerDistillationLossFn:
    """`loss=cross_tokenizer` with the digit teacher's projection for every teacher."""
    loss = build_loss(cfg.loss)
    projection = teacher_projection(cfg.data.modulus, cfg.model.vocab_size)
    return CrossTokenizerDistillationLossFn(loss.cfg, projections=(projection,) * loss.num_teachers)


def tokenize(input_ids: Tensor, input_lengths: Tensor, cfg: Config) -> tuple[Tensor, Tensor]:
    """The teacher's token ids `[B, teacher_width(cfg)]` (PAD after each row) and the student →
    teacher alignment `[B, S]` of the student rows `input_ids` `[B, S]`."""
    rows, width = input_ids.shape
    teacher_ids = torch.full((rows, teacher_width(cfg)), PAD, dtype=torch.long)
    student_lengths, teacher_lengths = [], []
    for b, row in enumerate(input_ids.tolist()):  # host: the demo's tokenizer
        tokens, student = [], []  # teacher tokens; the student tokens' text lengths
        for token in row[: int(input_lengths[b])]:
            if token < TASK_SPECIAL_TOKENS:  # PAD, BOS, EOS
                tokens.append(token)
                student.append(1)
            else:
                digits = [FIRST_DIGIT + int(c) for c in str(token - TASK_SPECIAL_TOKENS)]
                tokens += digits + [SPACE]
                student.append(len(digits) + 1)
        teacher_ids[b, : len(tokens)] = torch.tensor(tokens)
        student_lengths.append(student)
        teacher_lengths.append([1] * len(tokens))  # every teacher token is one character
    return teacher_ids, align_tokenizations(student_lengths, teacher_lengths, width)
