"""The audit room: the `compiled-loss-audit` CLI, the graph-break / recompile gate that
drives the compiled packing wrappers and the training step over realistic batches."""
