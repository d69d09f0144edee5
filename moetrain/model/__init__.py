"""LongCat-Flash-style shortcut-MoE transformer in Flax NNX."""
