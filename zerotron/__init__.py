"""zerotron: train GPT-style language models across many devices with data, ZeRO, tensor and
pipeline parallelism built from torch.distributed collectives."""

__version__ = "0.1.0"
