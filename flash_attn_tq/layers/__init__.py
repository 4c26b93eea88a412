"""Layers with the interface of ``flash_attn.layers`` (flash-attn 2.8.3), in plain PyTorch."""
