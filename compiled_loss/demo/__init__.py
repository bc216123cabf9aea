"""The demo room: data and models only. The embedded tiny causal LM (`model`), the synthetic
progression task (`data`: prompts, rewards, pre-made rows) and cross-tokenizer
distillation's digit-spelling teachers (`cross_tokenizer`); the application that trains on
them is `compiled_loss.app`."""
