"""A stand-in for the few torchvision names ``examples/dcgan.py`` uses (``datasets.FakeData``, ``transforms``,
``utils.save_image``), for machines where torchvision does not import beside the installed torch (PyPI's
torchvision fails next to the CPU torch 2.13 wheel: "operator torchvision::nms does not exist").

Put ``examples/stand_ins`` on ``PYTHONPATH`` only where ``import torchvision`` fails; with torchvision installed,
DCGAN uses the real one. This is not torchvision: it has only what that script calls.
"""

from . import datasets, transforms, utils  # noqa: F401
