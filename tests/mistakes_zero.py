"""Typical wrong answers to the zero exercises (to come)."""

MISTAKES = []
