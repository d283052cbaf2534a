"""How a command ends on bad input: one `error:` line and exit status 2 (`fail`), the load boundary
(`load_errors`), Ctrl-C as exit status 130 (`exit_on_interrupt`); never a traceback."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator, NoReturn

import typer

from mlx_dspark.engine.tree.fallback import EngineNote


def fail(message: str) -> NoReturn:
    """One `error:` line on stderr and exit status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


@contextmanager
def load_errors(what: str) -> Iterator[None]:
    """A command's load boundary: a bad file or field, or anything unexpected (named by its class), is one line."""
    try:
        yield
    except (ValueError, OSError) as err:  # FileNotFoundError included
        fail(str(err))
    except Exception as err:  # noqa: BLE001  (typer.Exit passes: it is the exit fail() asks for)
        if isinstance(err, typer.Exit):
            raise
        fail(f"loading {what} failed: {type(err).__name__}: {err} (please report this with the model's config.json)")


@contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """Ctrl-C (during the load or the generation): exit status 130, the shell's for SIGINT, no traceback.

    Also a decorator: `@exit_on_interrupt()` under `@app.command()`.
    """
    try:
        yield
    except KeyboardInterrupt:
        typer.echo("\n[mlx_dspark] interrupted", err=True)
        raise typer.Exit(code=130) from None


@contextmanager
def notes_as_lines() -> Iterator[None]:
    """The engine's notes (tree_fallback.EngineNote: tree rounds falling back to chains) as one `[mlx_dspark] note:`
    line each on stderr, each message once, after the block; other warnings are shown as Python would."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    said = set()
    for warning in caught:
        message = str(warning.message)
        if not issubclass(warning.category, EngineNote):
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
        elif message not in said:
            said.add(message)
            typer.echo(f"[mlx_dspark] note: {message}", err=True)
