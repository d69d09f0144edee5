"""Distillation: a student learns from a teacher's distribution (docs/distillation.md)."""
