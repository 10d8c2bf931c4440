"""Typical wrong answers to the ddp exercises (to come)."""

MISTAKES = []
