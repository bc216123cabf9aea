"""compiled_loss: NeMo-RL's post-training losses as stateless functions that trace to one
torch.compile graph over packed sequences with bucketed shapes.

Rooms by layer (a module imports only its own layer and the ones before it):

- `interfaces`, `metrics`: enums + the LossFunction protocol; the one aggregation registry
- `parallel`: process groups (single-process checks)
- `vocab`: `vocab_reduce`, the one `[N, V]` primitive; top-k / top-p thresholds; `DraftVocab`
- `packing`: CpuIntTuple boundaries, `PackedLayout` / `BucketGrid`, per-sequence and CP
  chunk maps, `sequence_packing_loss`
- `losses`: one module per family (policy gradient, NLL, preference + DPO, distillation,
  value, draft soft-CE) and their common helpers and config checks
- `inputs`: logits → what each loss consumes; the teacher side of on-policy distillation
- `draft`: the drafter runtime protocol and the draft soft-CE paths
- `wrapper`, `utils`, `loss_functions`, `loss_input`: the seed facades (NeMo-RL's modules)
- `config`: typed configs of every group, `build_loss`
- `train`: `build_train_step`, `compile_loss`, `CompileRecorder`
- `demo`: the embedded tiny LM, the synthetic task and its training loop
- `app`: Hydra (`python -m compiled_loss.run`); `audit`: the `compiled-loss-audit` CLI
"""
