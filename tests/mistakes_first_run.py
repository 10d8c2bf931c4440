"""Typical wrong answers to the first_run exercises (to come)."""

MISTAKES = []
