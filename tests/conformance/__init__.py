"""The conformance suite's models: PyTorch's own FSDP test models, Hugging Face families, constructs."""
