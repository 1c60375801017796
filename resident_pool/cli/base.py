"""What every command shares: the app, the console, the options, the manifests folder and provider names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from ..arrays import plain
from ..errors import ResidentPoolError
from ..providers.manifest import SLUG
from ..providers.transcripts import without_controls
from ..version import __version__

if TYPE_CHECKING:
    from ..host.paths import Paths
    from ..settings import Settings

__all__ = ["AsJson", "ManifestsOption", "app", "check_slug", "configured", "console", "display_name", "errors",
           "fail", "known_providers", "manifests_dir", "print_json", "require_provider", "safe"]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"resident-pool {__version__}")
        raise typer.Exit


app = typer.Typer(help="Keep model workers warm within a GPU memory budget.", no_args_is_help=True,
                  pretty_exceptions_enable=False)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", callback=_version,
                                          is_eager=True)] = False,
) -> None:
    """Keep model workers warm within a GPU memory budget."""
    chosen["json"] = False  # each command's own --json says (an app run in-process runs several)


# Tables are wide; a pipe or a CI log gets 160 columns rather than rich's 80. $COLUMNS wins, as for any tool.
console = Console(width=shutil.get_terminal_size((160, 24)).columns)
errors = Console(stderr=True, width=console.width)

ManifestsOption = Annotated[
    Path | None,
    typer.Option(
        "--manifests", help="Folder of <slug>/manifest.toml (default: $RESIDENT_POOL_MANIFESTS, else ./manifests "
        "where it exists, else the running pool's folder).",
    ),
]
# The running command's --json, for a failure before the command reads its own (a bad setting in ``configured``).
chosen: dict[str, bool] = {"json": False}


def json_chosen(value: bool) -> bool:
    """Every --json flag's callback: the failures ``configured`` ends a command with are an object under it too."""
    chosen["json"] = bool(value)
    return value


AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON, for scripts.", callback=json_chosen)]


def safe(value: object) -> str:
    """Text from a worker, a transcript or a payload: no rich markup, no terminal control characters."""
    return escape(without_controls(str(value)))


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=plain))  # arrays as nested lists, bytes as base64


def fail(message: str, as_json: bool = False, reason: str = "error", code: int = 1) -> NoReturn:
    """End the command: the message on stderr (and as ``{"error", "reason"}`` on stdout under --json)."""
    if as_json:
        typer.echo(json.dumps({"error": without_controls(message), "reason": reason}))
    typer.echo(without_controls(message), err=True)  # unwrapped: a terminal wraps it, a log keeps it whole
    raise typer.Exit(code)


def configured() -> tuple[Settings, Paths]:
    """The settings as this command's environment gives them, and the folders they name: read here, at the edge,
    and handed to what the command calls."""
    from ..host.paths import Paths
    from ..settings import settings

    try:
        config = settings()
    except ResidentPoolError as exc:  # a bad RESIDENT_POOL_* value: its sentence, and no command runs on a guess
        fail(str(exc), as_json=chosen["json"], reason=exc.reason, code=2)
    return config, Paths.of(config)


def manifests_dir(option: Path | None) -> Path:
    """--manifests, else $RESIDENT_POOL_MANIFESTS, else ./manifests where it exists, else the running pool's."""
    from ..client import default_manifests

    return default_manifests(option, *configured())


def display_name(key: str) -> str:
    """A provider as a user names it: a check's own build (``slug~declared-1d2c9f``) is ``slug (check: declared)``."""
    slug, tilde, variant = key.partition("~")
    if not tilde:
        return key
    return f"{slug} (check: {variant.rsplit('-', 1)[0]})"


def known_providers(folder: Path) -> list[str]:
    """The slugs with a manifest in ``folder``."""
    return sorted(path.parent.name for path in folder.glob("*/manifest.toml")) if folder.is_dir() else []


def check_slug(slug: str) -> None:
    """A usage error (exit 2) for a name that cannot be a provider's: a path, markup, upper case."""
    if not SLUG.fullmatch(slug):
        raise typer.BadParameter(f"{slug!r} is not a provider name (lowercase letters, digits, '-' and '_', "
                                 "as its manifests folder is named)", param_hint="SLUG")


def require_provider(slug: str, folder: Path, also: set[str] = frozenset(), as_json: bool = False) -> None:
    """Exit 1, naming the folder and the providers it has, unless ``slug`` is one of them (or of ``also``)."""
    check_slug(slug)
    if slug in also or (folder / slug / "manifest.toml").is_file():
        return
    known = sorted(set(known_providers(folder)) | also)
    where = f"{folder} has {', '.join(known)}" if known else f"{folder} holds no provider"
    fail(f"{slug}: no provider of that name ({where}); check the name, or pass --manifests DIR",
         as_json, reason="unknown_provider")
