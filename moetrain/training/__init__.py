"""The training computation: the train state, the pure step functions, the optimizer, and the steps compiled ahead of time from shapes."""
