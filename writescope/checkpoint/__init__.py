"""Hugging Face checkpoint directories: loading, synthetic weights, writing, tokenizers."""
