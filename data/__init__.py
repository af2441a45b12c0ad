"""Prompt sets read by both the benchmark and the trainer (depends on neither)."""
