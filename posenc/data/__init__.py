"""Data: corpora (embedded stdlib, local text, Hugging Face), the byte tokenizer, memmap cache, data modules."""
