"""Checkpoint file formats: safetensors (header parsed by us for byte offsets) and directories."""
