"""One command line for every launcher: ``--accelerator --strategy --devices --num-nodes --precision``.

A script adds these options with :func:`add_launch_arguments` and hands
:func:`launch_kwargs` to ``FabricLearner``. Its defaults (say, 2 CPU ranks under DDP) apply when
it is run with plain ``python``, where the learner starts the other ranks itself; under
``fabric run`` or ``torchrun`` the launcher decides, and only the options typed on the
command line are passed on, so they must agree with it (``FabricLearner`` refuses a
disagreement before anything starts).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from fabric_learner.launch.build import launcher

__all__ = ["DefaultsHelpFormatter", "add_launch_arguments", "launch_kwargs", "launcher"]

_NAMES = ("accelerator", "strategy", "devices", "num_nodes", "precision")
_DEFAULTS_KEY = "_fabric_learner_launch_defaults"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows what an option takes when it is not given: ``(default: X)``.

    Unlike argparse's ``ArgumentDefaultsHelpFormatter`` it also shows the default of an option
    written without a help text, and leaves alone flags (``store_true``), options without a
    default (``None``) and help texts that already say theirs. Text written for the docs reads
    plainly: a description or help taken from a docstring loses its reST double backquotes.

    Examples:
        >>> import argparse
        >>> from fabric_learner.cli import DefaultsHelpFormatter
        >>> parser = argparse.ArgumentParser(prog="train.py", formatter_class=DefaultsHelpFormatter)
        >>> _ = parser.add_argument("--steps", type=int, default=100, help="optimizer updates")
        >>> _ = parser.add_argument("--seed", type=int, default=0)
        >>> print(parser.format_help().split("options:")[1].strip())
        -h, --help     show this help message and exit
          --steps STEPS  optimizer updates (default: 100)
          --seed SEED    default: 0
    """

    def _format_action(self, action: argparse.Action) -> str:
        if (action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS)
                and "default" not in (action.help or "") and action.help is not argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        return super()._format_action(action)

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("``", ""))

    def _expand_help(self, action: argparse.Action) -> str:
        return super()._expand_help(action).replace("``", "")


def devices_arg(value: str) -> int | str:
    """``--devices``: a number of devices per node, ``auto``, or a list such as ``0,1``."""
    return int(value) if value.lstrip("-").isdigit() else value


def add_launch_arguments(parser: argparse.ArgumentParser, *, accelerator: str = "auto", strategy: str = "auto",
                         devices: int | str = "auto", num_nodes: int = 1,
                         precision: str = "32-true") -> argparse.ArgumentParser:
    """Add ``--accelerator --strategy --devices --num-nodes --precision`` to ``parser``.

    Args:
        parser: the script's argument parser.
        accelerator, strategy, devices, num_nodes, precision: what the script does when run with
            plain ``python`` and the option is not given (``FabricLearner``'s arguments of the same
            names). Under ``fabric run`` and ``torchrun`` an option not given leaves the launcher's
            choice.

    Returns:
        the parser.

    Examples:
        >>> import argparse
        >>> from fabric_learner.cli import add_launch_arguments, launch_kwargs
        >>> parser = add_launch_arguments(argparse.ArgumentParser(), accelerator="cpu", strategy="ddp", devices=2)
        >>> launch_kwargs(parser.parse_args(["--strategy", "fsdp"]))  # plain python
        {'accelerator': 'cpu', 'strategy': 'fsdp', 'devices': 2, 'num_nodes': 1, 'precision': '32-true'}
    """
    group = parser.add_argument_group("launch (plain python defaults; fabric run and torchrun decide otherwise)")
    group.add_argument("--accelerator", default=None, help=f"cpu, gpu, cuda, mps or auto (default {accelerator})")
    group.add_argument("--strategy", default=None, help=f"ddp, fsdp, auto, ... (default {strategy})")
    group.add_argument("--devices", type=devices_arg, default=None, help=f"a number per node or auto (default {devices})")
    group.add_argument("--num-nodes", type=int, default=None, help=f"machines the run spans (default {num_nodes})")
    group.add_argument("--precision", default=None, help=f"32-true, bf16-mixed, 16-mixed, ... (default {precision})")
    parser.set_defaults(**{_DEFAULTS_KEY: {"accelerator": accelerator, "strategy": strategy, "devices": devices,
                                           "num_nodes": num_nodes, "precision": precision}})
    return parser


def launch_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``FabricLearner`` keyword arguments for the parsed options.

    Under plain ``python``: the script's defaults, overridden by the options given. Under
    ``fabric run`` or ``torchrun``: only the options given.

    Examples:
        >>> import argparse
        >>> from fabric_learner.cli import add_launch_arguments, launch_kwargs
        >>> parser = add_launch_arguments(argparse.ArgumentParser(), devices=2)
        >>> launch_kwargs(parser.parse_args(["--precision", "bf16-mixed"]))  # plain python
        {'accelerator': 'auto', 'strategy': 'auto', 'devices': 2, 'num_nodes': 1, 'precision': 'bf16-mixed'}

        Under ``torchrun`` the same call gives ``{'precision': 'bf16-mixed'}``: the launcher decides the rest.
    """
    defaults = getattr(args, _DEFAULTS_KEY, None)
    if defaults is None:
        raise ValueError("launch_kwargs(args) needs a parser prepared with add_launch_arguments(parser).")
    given = {name: getattr(args, name) for name in _NAMES if getattr(args, name) is not None}
    if launcher() == "python":
        return {**defaults, **given}
    return given


def main(argv: list[str] | None = None) -> None:
    """``python -m fabric_learner.cli [OPTIONS]``: the ``FabricLearner`` arguments these options give here."""
    parser = argparse.ArgumentParser(
        prog="python -m fabric_learner.cli", formatter_class=DefaultsHelpFormatter,
        description="The launch options that add_launch_arguments(parser) gives a training script, the same under "
                    "plain python, fabric run and torchrun. Run with options, this prints the FabricLearner keyword "
                    "arguments that launch_kwargs(args) gives for them under the launcher that started it (here, "
                    "with no script's own defaults: FabricLearner's). In a script: parser = argparse.ArgumentParser(); "
                    "add_launch_arguments(parser, accelerator='cpu', strategy='ddp', devices=2); "
                    "FabricLearner(loss, optim, **launch_kwargs(parser.parse_args())).")
    add_launch_arguments(parser)
    print(launch_kwargs(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
