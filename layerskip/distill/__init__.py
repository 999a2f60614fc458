"""Self-distillation of exit adapters: the corpus, the teacher forward and the training loop."""
