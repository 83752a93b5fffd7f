"""Quality: the synthetic reasoning task, its tokenizer, training, and the evaluations."""
