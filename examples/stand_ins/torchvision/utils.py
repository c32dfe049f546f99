"""``save_image``: the images a DCGAN run writes now and then, as a tensor file (no image library here)."""

from __future__ import annotations

from typing import Any

import torch


def save_image(tensor: Any, fp: Any, **kwargs: Any) -> None:
    torch.save(tensor.detach().cpu(), fp)
