"""moetrain: train and fine-tune Mixture-of-Experts language models with JAX/Flax."""
