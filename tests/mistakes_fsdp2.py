"""Typical wrong answers to the fsdp2 exercises (to come)."""

MISTAKES = []
