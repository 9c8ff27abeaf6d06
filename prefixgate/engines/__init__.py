"""Adapters for serving engines that are not prefixgate's own (see vllm.py)."""
