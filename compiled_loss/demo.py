"""`python -m compiled_loss.demo`: a compiled packed GRPO loss + metrics on synthetic data.

Packs a few micro-batches of random-length sequences (host-side layout, bucketed shapes),
runs the fused packing wrapper compiled with Inductor, checks it against eager, and prints
the loss, the metrics and how many times it compiled.
"""

from __future__ import annotations

import math
import random
import time

import torch

from compiled_loss.audit import CompileRecorder
from compiled_loss.layout import BucketGrid
from compiled_loss.loss_functions import ClippedPGLossFn
from compiled_loss.loss_input import prepare_packed_loss_input
from compiled_loss.metrics import metrics_to_python
from compiled_loss.wrapper import SequencePackingFusionLossWrapper

VOCAB, WIDTH, ROWS = 4096, 256, 8


def micro_batch(rng: random.Random, gen: torch.Generator):
    """Data `[B, S]` for one micro-batch and its boundaries (prompt + response lengths)."""
    lengths = [rng.randint(16, WIDTH) for _ in range(rng.randint(ROWS // 2, ROWS))]
    padded = [-(-n // 8) * 8 for n in lengths]
    rows = len(lengths)
    token_mask = torch.zeros(rows, WIDTH)
    for i, n in enumerate(lengths):
        token_mask[i, n // 4 : n] = 1  # response tokens after a prompt
    # random N(0, 1) logits give log-probs around -log(V) - 1/2
    gen_lp = -math.log(VOCAB) - 0.5 + 0.3 * torch.randn(rows, WIDTH, generator=gen)
    data = {
        "input_ids": torch.randint(0, VOCAB, (rows, WIDTH), generator=gen),
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, 1, generator=gen).expand(rows, WIDTH).contiguous(),
        "generation_logprobs": gen_lp,
        "prev_logprobs": gen_lp + 0.05 * torch.randn(rows, WIDTH, generator=gen),
        "reference_policy_logprobs": gen_lp + 0.1 * torch.randn(rows, WIDTH, generator=gen),
    }
    cu = [0]
    cu_padded = [0]
    for n, p in zip(lengths, padded):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + p)
    return data, tuple(cu), tuple(cu_padded)


def main() -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})
    grid = BucketGrid(tokens=512, rows=8, width=256)
    recorder = CompileRecorder("inductor", "fused GRPO")
    compiled = recorder.compile(lambda w, *a: w(*a), fullgraph=True)
    for step in range(4):
        data, cu, cu_padded = micro_batch(rng, gen)
        wrapper = SequencePackingFusionLossWrapper(
            loss_fn, prepare_packed_loss_input, cu, cu_padded, bucket=grid
        )
        data = wrapper.layout.pad_data(data)  # host side: bucket shapes, before compiled code
        logits = torch.randn(1, wrapper.layout.tokens, VOCAB, generator=gen, requires_grad=True)
        g_seqs = data["sample_mask"].sum()
        g_toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
        start = time.perf_counter()
        loss, metrics = compiled(wrapper, logits, data, g_seqs, g_toks)
        loss.backward()
        seconds = time.perf_counter() - start
        eager_loss, _ = wrapper(logits, data, g_seqs, g_toks)
        print(
            f"micro-batch {step}: {len(cu) - 1} sequences, {cu[-1]} tokens (bucket "
            f"{wrapper.layout.tokens}), loss {loss.item():.6f} (eager {eager_loss.item():.6f}), "
            f"fwd+bwd {seconds:.2f}s, compiles so far {recorder.report.compiles}"
        )
    for key, value in metrics_to_python(metrics).items():
        print(f"  {key:28s} {value: .6f}")
    problems = recorder.report.problems()
    print(f"compiles: {recorder.report.compiles}, graph breaks / syncs / eager fallbacks: {problems or 'none'}")


if __name__ == "__main__":
    main()
