"""Checkpoint interop with other frameworks (Hugging Face safetensors, PEFT adapters)."""
