"""The demo room: the embedded tiny causal LM, the synthetic progression task with what
every loss family needs, and the training loop `python -m compiled_loss.run` runs."""
