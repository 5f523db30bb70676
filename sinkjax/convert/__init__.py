"""Checkpoint conversion to and from other frameworks (`hf`: Hugging Face transformers, safetensors only)."""
