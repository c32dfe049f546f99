"""Imported first by ``launch``'s fork server (its preload, :mod:`service.ops.warm`): the fork server ignores the
stop signals. Slurm's ``scancel`` and a container's stop signal every process of the step or the pod, and a fork
server ended by one would end every worker through its parent-death signal before it could checkpoint. The
workers it forks set their own handlers at their first line (``service/worker.py``)."""

from service import early

early.ignore()
