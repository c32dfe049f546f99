"""A script in the module-level form of a session (``s = service.Session().start()``, no ``with``), a linear model
on 32 random samples; with ``raise`` as its last argument, it raises a ValueError after its loop, uncaught."""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import service

s = service.Session().start()
net = s.model(nn.Linear(4, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
s.keep(net=net, opt=opt)
for x, y in s.batches(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    s.log(loss=loss)
if sys.argv[-1] == "raise":
    raise ValueError("the script's own error after its loop")
