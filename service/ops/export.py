"""``ddp-service export RUN_DIR [--step N|best|latest] [--module NAME] [--format safetensors|pt] OUT``: the weights
alone (of one kept module: a task job's model, or the one a script's ``s.keep`` named).

The checkpoint is read only after its manifest's checks pass; the file written
holds the model's state dict (no ``module.``/``_orig_mod.`` prefix) and
nothing else, for ``load_state_dict(safetensors.torch.load_file(OUT))`` or
``load_state_dict(torch.load(OUT, weights_only=True))``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2


def add_parser(commands: Any) -> None:
    command = commands.add_parser("export", help="write a checkpoint's model weights alone, for inference")
    command.add_argument("run_dir", help="the run's run_dir (or its checkpoints/ directory)")
    command.add_argument("out", help="the file to write (its directory must exist)")
    command.add_argument("--step", default="latest", help="a step number, latest (the default) or best")
    command.add_argument(
        "--module",
        default=None,
        metavar="NAME",
        help="the kept module to write (a script's s.keep name, e.g. netG); default: the only one",
    )
    command.add_argument("--format", dest="fmt", choices=("safetensors", "pt"), default=None,
                         help="default: pt for an OUT ending in .pt or .pth, else safetensors")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from service.state.checkpoint_io import pick_step
    from service.state.weights import WeightsError, check_out, checkpoint_weights, export_weights

    run_dir, out = Path(args.run_dir), Path(args.out)
    fmt = args.fmt or ("pt" if out.suffix in (".pt", ".pth") else "safetensors")
    try:
        if not run_dir.is_dir():
            raise WeightsError(f"{run_dir} is not a directory; pass the run_dir of a training run")
        check_out(out)  # a device, a FIFO, a directory or a symlink at OUT is refused, before any reading
        if not out.parent.is_dir():
            raise WeightsError(f"the directory of {out} does not exist; create it first (mkdir -p {out.parent})")
        directory, step = pick_step(run_dir, args.step)
        weights = checkpoint_weights(directory, step, args.module)
        copies = export_weights(weights, out, fmt, {"ddp_service_step": str(step), "source": str(run_dir)})
    except WeightsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"error: could not write {out}: {exc.strerror or exc}; check that its directory is writable and "
              "has room", file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    tied = f", {copies} tied tensors written as copies" if copies else ""
    print(f"exported step {step} of {run_dir}: {len(weights)} tensors, {size / 2**20:.1f} MiB, {fmt}{tied} -> {out}")
    return 0
