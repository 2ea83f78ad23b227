"""BERT pretraining with LAMB and 1-bit LAMB."""

from pretrain.host_memory import request_huge_pages

# before the first CPU allocation, which is when PyTorch reads it (pretrain/host_memory.py)
request_huge_pages()
