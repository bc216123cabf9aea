"""NeMo-RL's calling convention, at the library's one edge: the seed's modules with their
names and signatures, over the library below (which takes one `ParallelGroups`).

- `wrapper`, `utils`, `loss_functions`, `loss_input`: the seed's modules
  (`nemo_rl.algorithms.loss.*`): the packing and draft wrappers, `sequence_packing_loss`,
  `wrap_loss_fn_with_input_preparation`, the `prepare_*` shells, the `get_*_from_logits`
  functions, `map_teacher_logits_to_draft_vocab`, `reconstruct_opd_full_teacher_logits`,
  `DraftCrossEntropyLossFn` and the draft soft-CE kernels taking `tp_group`;
- `groups`: the seed's `vocab_parallel_rank` / `vocab_parallel_group` /
  `context_parallel_group` arguments (and DTensor logits) converted into `ParallelGroups`.
"""
