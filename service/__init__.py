"""ddp-service: elastic multi-node PyTorch DDP training.

Kept import-light: torchrun imports ``service.rendezvous`` through an entry point.
"""

__version__ = "0.1.0"
