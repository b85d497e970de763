"""Capture: the model's graph from torch.fx or torch.export, and fake tensors for models on the
meta device."""
