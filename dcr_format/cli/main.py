"""The ``dcr`` command: the group, its error handling, and the entry point.

The commands live in one module per group (:mod:`~dcr_format.cli.transfer`,
:mod:`~dcr_format.cli.browse`, :mod:`~dcr_format.cli.maintain`,
:mod:`~dcr_format.cli.explore`); a command's module is imported when the command is
looked up (``dcr log`` imports :mod:`~dcr_format.cli.browse` alone), and each command
imports what it needs when it runs, so ``dcr --version`` and ``dcr --help`` import
neither torch nor pydantic.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import click

from dcr_format.cli.params import SHOW_DEFAULTS, one_line
from dcr_format.errors import DcrError
from dcr_format.system.collector import collector_off

COMMAND_MODULES: dict[str, str] = {
    "publish": "transfer",
    "pull": "transfer",
    "log": "browse",
    "show": "browse",
    "diff": "browse",
    "replay": "browse",
    "plot": "browse",
    "verify": "maintain",
    "compact": "maintain",
    "gc": "maintain",
    "doctor": "maintain",
    "readers": "maintain",
    "project": "explore",
    "demo": "explore",
}
"""Each command of ``dcr`` and the module of :mod:`dcr_format.cli` that defines it (in the
module's ``COMMANDS``), imported when the command is looked up."""

_NO_SUCH_COMMAND: Any = getattr(click.exceptions, "NoSuchCommand", None)  # click >= 8.4


def _debug() -> bool:
    return os.environ.get("DCR_DEBUG", "") not in ("", "0")


class _Group(click.Group):
    """Every failure caused by the input is one line on stderr.

    Usage errors (a bad option or argument, caught by click before any work) exit
    with status 2 and name the ``--help`` to read; a ``DcrError`` exits with 1,
    and so does a ``ValueError``, ``TypeError`` or ``OSError`` that no check caught.
    Any other exception is a bug and keeps its traceback; ``DCR_DEBUG=1`` shows
    the traceback of every error.

    The commands of :data:`COMMAND_MODULES` are looked up by name, each module imported
    only when one of its commands is asked for.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMAND_MODULES, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMAND_MODULES.get(cmd_name)
        if module is None:
            return super().get_command(ctx, cmd_name)
        commands: tuple[click.Command, ...] = importlib.import_module(
            f"dcr_format.cli.{module}"
        ).COMMANDS
        return next(command for command in commands if command.name == cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:  # click >= 8.4 suggests names: every command's
            if _NO_SUCH_COMMAND is None or not isinstance(exc, _NO_SUCH_COMMAND):
                raise
            raise _NO_SUCH_COMMAND(
                exc.command_name, possibilities=self.list_commands(ctx), ctx=ctx
            ) from None

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        call = dict(args=args, prog_name=prog_name, complete_var=complete_var, **extra)
        if not standalone_mode:
            return super().main(standalone_mode=False, **call)
        try:
            code = super().main(standalone_mode=False, **call)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # `dcr` alone: the help text, as click prints it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "dcr"
            click.echo(
                f"dcr: error: {one_line(exc.format_message())} (see '{where} --help')", err=True
            )
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"dcr: error: {one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("dcr: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise
        except DcrError as exc:
            if _debug():
                raise
            click.echo(f"dcr: error: {one_line(exc)}", err=True)
            sys.exit(1)
        except (ValueError, TypeError, OSError) as exc:
            if _debug():
                raise
            text = one_line(exc) or type(exc).__name__
            click.echo(
                f"dcr: error: {text}; check the arguments (DCR_DEBUG=1 shows where it failed)",
                err=True,
            )
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("dcr: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, name="dcr", context_settings=SHOW_DEFAULTS)
@click.version_option(package_name="dcr-format")
def cli() -> None:
    """Bit-exact delta refit of model weights through object storage."""


class _Process:
    """Whether this process is the ``dcr`` command (:func:`main`), whose collector
    :func:`command_imports` may tune; not a process that calls :data:`cli` in-process."""

    own = False
    warning_lines = False  # the library's warnings print as ``dcr: warning:`` lines


def _warning_lines() -> None:
    """Print the library's warnings (logger ``dcr_format``, WARNING and up) as one
    ``dcr: warning: ...`` line each on stderr, like the command's own lines; once."""
    import logging

    if _Process.warning_lines:
        return
    handler = logging.StreamHandler()  # stderr
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("dcr: warning: %(message)s"))
    logging.getLogger("dcr_format").addHandler(handler)
    _Process.warning_lines = True


@contextlib.contextmanager
def command_imports() -> Iterator[None]:
    """The block where a command imports what it needs (torch, the models, the package).

    In the ``dcr`` process the library's warnings print as ``dcr: warning: ...`` lines, and
    the cyclic garbage collector is off within the block and the objects the block left
    are frozen after it (:func:`gc.freeze`): an import makes
    hundreds of thousands of objects that live as long as the process, and the collector's
    full passes over them (during the imports, numba's set-up after them, and at exit),
    which find nothing, cost a publish or a pull 0.7-0.9 s of CPU. The work after the block
    collects its own garbage as usual. Elsewhere (a caller invoking :data:`cli` in its own
    process) the block changes nothing.
    """
    if not _Process.own:
        yield
        return
    _warning_lines()
    with collector_off(freeze=True):
        yield


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point.

    Unless the environment says otherwise, the OpenMP threads of the compiled kernels (and
    of torch) sleep between parallel kernels instead of spinning: a command runs many short
    kernels, and the spinning cost a pull about 0.6 s of CPU that other work on the machine
    could have had (``OMP_WAIT_POLICY``, read when OpenMP loads, after this).
    """
    _Process.own = True
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cli.main(args=list(argv) if argv is not None else None, prog_name="dcr")
