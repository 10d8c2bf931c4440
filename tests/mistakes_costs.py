"""Typical wrong answers to the costs exercises (to come)."""

MISTAKES = []
