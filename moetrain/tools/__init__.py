"""Command-line tools: plan (dry run), evaluate, generate, expert-load plots."""
