"""Typical wrong answers to the pinned exercises (to come)."""

MISTAKES = []
