"""compiled_loss: NeMo-RL's post-training losses as stateless functions that trace to one
torch.compile graph over packed sequences with bucketed shapes.

Rooms by layer (a module imports only its own layer and the ones before it; the "Package
map" of docs/design.md has the files):

- `interfaces`, `metrics`, `checks`, `compile`: enums, the `LossFunction` protocol and the
  `InputSpec` a loss declares; the one aggregation registry; config checks; `compile_loss`
- `parallel`: `ParallelGroups` (tp / cp / dp), the one parallel object below the edge; the
  agreement check, traceable collectives
- `vocab`: `vocab_reduce`, the one `[N, V]` primitive; `LinearLogits`; top-k / top-p
  thresholds; `DraftVocab`
- `packing`: CpuIntTuple boundaries, `PackedLayout` / `BucketGrid`, CP shards, the token view
  (`RowsView`, `PackedView`) and `micro_batch_loss`, the one micro-batch entry point
- `losses`: one module per family (policy gradient, NLL, preference + DPO, distillation,
  cross-tokenizer, value, draft soft-CE) and their common helpers and config checks
- `inputs`: one preparer per input type (the table), `validate_batch`, the teacher side of
  on-policy distillation
- `draft`: the co-trained drafters (EAGLE-3, DFlash), their shared parts and runtime protocol
- `nemo_rl`: NeMo-RL's calling convention, the one edge (the seed's modules and signatures,
  their group arguments converted into `ParallelGroups`); `wrapper`, `utils`,
  `loss_functions`, `loss_input`: the same modules under the seed's names
- `config`: typed configs of every group, one option class per loss and drafter, `build_loss`
- `train`: `TrainStep` / `StepOptions` / `build_train_step`, `init_parallel`, `CompileRecorder`
- `demo`: the embedded tiny LM, the synthetic task and the cross-tokenizer teachers
- `app`: the application (run loop, rollouts, sampler, checkpoints, curves, Hydra:
  `python -m compiled_loss.run`); `audit`: the `compiled-loss-audit` CLI
"""

__version__ = "0.1.0"
