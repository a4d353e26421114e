"""Prompt generators of the self-distillation sets listed in training/corpus.toml: one module per
set (distill2 ... distill9; distill is hand-written), each with generate(ctx) -> the text of the
set's prompt file, and common.py for what they share. Run them through training/make-prompts."""
