"""Input pipeline: tokenizers, record sources, packing and deterministic grain iterators."""
