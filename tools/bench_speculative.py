"""`python tools/bench.py speculative`: speculative sampling against plain decoding, with the
profile that explains the ratio.

For each drafter and batch size (`--rows` prompts of the default task, one response each),
the policy and the drafter at their initialisation (near-uniform distributions, so most
drafts are accepted: τ about 2.5 at γ = 4), each compiled (Inductor unless `--backend`):

- `plain_ms` / `spec_ms`: median wall time of a whole batch, plain decoding (one policy
  forward per token) and speculative (`compiled_loss.app.speculative`), and their ratio
  `speedup`; `tau` (tokens a row gains per policy forward) and `rounds` (policy forwards of
  the batch after the prompt: the batch runs until its slowest row ends);
- the parts of a round, each compiled alone and timed on the same shapes: `decode_ms` (one
  plain decoding step, the unit), `verify_ms` (one policy forward of γ + 1 tokens),
  `propose_ms` (the drafter's γ proposals); `round_ms` = `spec_ms` / `rounds`.

Speculation pays when a round costs less than `tau` decoding steps. A CPU runs the
verifying forward's matmuls at the rate it runs one token's once the batch fills its
vector units, so `verify_ms` grows with γ + 1 while `decode_ms` does not shrink: the row
`verify/decode` says which regime a batch is in. Each (drafter, rows) runs in its own
subprocess; one thread (`--threads`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from compiled_loss.app import compose_config
from compiled_loss.app.sampler import Sampler, log_probs, sampling_uniforms
from compiled_loss.app.speculative import SpeculativeSampler, _sampling, _Settings, _start, speculative_uniforms
from compiled_loss.config import build_draft_runtime
from compiled_loss.demo.data import prompt_width, response_width, task_prompts
from compiled_loss.demo.model import TinyLM


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up (the compile)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(draft: str, rows: int, gamma: int, backend: str, repeat: int, overrides: list[str]) -> dict:
    cfg = compose_config(
        f"draft={draft}",
        "run.speculative=true",
        f"run.speculative_tokens={gamma}",
        f"data.prompts={rows}",
        "data.group_size=1",
        "run.micro_batches=1",
        f"compile.backend={backend}",
        *overrides,
    )
    torch.manual_seed(0)
    policy = TinyLM(cfg.model)
    runtime = build_draft_runtime(cfg.draft, cfg.model, policy)
    prompts = task_prompts(cfg.data, cfg.model.vocab_size, random.Random(0), rows)
    slots = response_width(cfg.data)
    plain, spec = Sampler(cfg, policy, rows), SpeculativeSampler(cfg, policy, runtime, rows)
    plain_uniforms, spec_uniforms = sampling_uniforms(0, 0, rows, slots), speculative_uniforms(0, 0, rows, slots)
    out = {"draft": draft, "rows": rows, "gamma": gamma}
    out["plain_ms"] = _median_ms(lambda: plain(prompts, plain_uniforms), repeat)
    samples = spec(prompts, spec_uniforms)
    out["spec_ms"] = _median_ms(lambda: spec(prompts, spec_uniforms), repeat)
    out["tau"], out["rounds"] = samples.tau, _rounds(spec, prompts, spec_uniforms)

    # the parts of a round, on the state after the prompt
    lp = cfg.logprob
    logp = functools.partial(log_probs, temperature=lp.temperature, top_k=lp.top_k, top_p=lp.top_p)
    cache_len = prompt_width(cfg.data) + slots + gamma + 1
    padded = torch.cat([spec_uniforms, spec_uniforms[:, -1:].expand(-1, gamma + 2, -1)], 1)
    with torch.no_grad():
        settings = _Settings(gamma, cache_len, slots, slots + gamma + 2, logp)
        carry = _start(policy, runtime, prompts.input_ids, prompts.lengths, padded, settings=settings)
        state, y, pos, cache = carry.state, carry.y, carry.pos, carry.cache
        compile_ = functools.partial(torch.compile, backend=backend, fullgraph=True, dynamic=False)
        decode = compile_(lambda: policy.decode(y, pos, cache))
        tokens = y[:, None].expand(-1, gamma + 1).contiguous()
        verify = compile_(lambda: policy.extend(tokens, pos, cache, runtime.aux_layers))
        sample = _sampling(logp, cfg.model.vocab_size)
        propose = compile_(lambda: runtime.propose(state, pos, padded[:, :gamma, 0], sample))  # the drafts' uniforms
        for name, fn in (("decode_ms", decode), ("verify_ms", verify), ("propose_ms", propose)):
            out[name] = _median_ms(fn, repeat * 4)
    out["round_ms"] = out["spec_ms"] / out["rounds"]
    out["speedup"] = out["plain_ms"] / out["spec_ms"]
    return out


def _rounds(spec: SpeculativeSampler, prompts, uniforms) -> int:
    """The rounds one batch runs (counted by wrapping the compiled round)."""
    count, inner = [0], spec._round

    def counted(*args):
        count[0] += 1
        return inner(*args)

    spec._round = counted
    try:
        spec(prompts, uniforms)
    finally:
        spec._round = inner
    return count[0]


COLUMNS = [
    ("draft", "{}"),
    ("rows", "{}"),
    ("tau", "{:.2f}"),
    ("rounds", "{}"),
    ("plain_ms", "{:.1f}"),
    ("spec_ms", "{:.1f}"),
    ("speedup", "{:.2f}"),
    ("decode_ms", "{:.2f}"),
    ("verify_ms", "{:.2f}"),
    ("propose_ms", "{:.2f}"),
    ("round_ms", "{:.2f}"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tools/bench.py speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", nargs="+", default=["eagle3", "dflash"], choices=["eagle3", "dflash"])
    parser.add_argument("--rows", nargs="+", type=int, default=[128, 8, 1], help="prompts per batch")
    parser.add_argument("--gamma", type=int, default=4, help="run.speculative_tokens")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. draft.draft_vocab_size=128")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure(spec["draft"], spec["rows"], args.gamma, args.backend, args.repeat, args.overrides)))
        return
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), γ = {args.gamma}, backend {args.backend}, "
        f"overrides {args.overrides or 'none'}, "
        f"load average {os.getloadavg()[0]:.2f} (timings assume an otherwise idle machine)"
    )
    print("  ".join(f"{name:>10}" for name, _ in COLUMNS) + "  verify/decode  propose/decode")
    failed = False
    for draft in args.draft:
        for rows in args.rows:
            worker = json.dumps({"draft": draft, "rows": rows})
            command = [sys.executable, __file__, "--worker", worker, "--gamma", str(args.gamma)]
            command += ["--backend", args.backend, "--repeat", str(args.repeat), "--threads", str(args.threads)]
            command += args.overrides
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(f"{draft} rows={rows}: failed\n{done.stderr[-2000:]}")
                failed = True
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            cells = "  ".join(f"{fmt.format(r[name]):>10}" for name, fmt in COLUMNS)
            print(f"{cells}  {r['verify_ms'] / r['decode_ms']:>13.2f}  {r['propose_ms'] / r['decode_ms']:>14.2f}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
