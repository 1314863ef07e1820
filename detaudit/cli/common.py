"""What every command shares: consoles, the bad-input contract (one line, exit 2), JSON output, and
the options declared once (typer `Annotated` aliases; enums for fixed choices)."""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from detaudit.config import DecodingParams
from detaudit.errors import CellFailed, DetauditError

DEFAULT_MODEL = "smollm2-135m"
SAMPLING = DecodingParams()  # the published sampling defaults, in one place
ALL_BACKENDS = "bf16,bio,bio+tbik"  # --backends default


class _Console(Console):
    """A console that follows the terminal's width, or COLUMNS, read at each use rather than at import
    (the environment a command runs under is the one its output goes to, also when the CLI is imported
    once and invoked many times: typer's CliRunner, an embedding program). Piped into a file or a CI log
    (no terminal, no COLUMNS) it is 160 columns wide instead of rich's 80, which folded the summary
    table's columns into unreadable slivers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # rich keeps the COLUMNS / LINES of the environment it was made in as a fixed size: unless a size
        # was asked for, they are read at each use instead (`size`)
        if kwargs.get("width") is None:
            self._width = None
        if kwargs.get("height") is None:
            self._height = None

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and not self.is_terminal and not os.environ.get("COLUMNS"):
            return ConsoleDimensions(160, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


out = _Console()
err = _Console(stderr=True)


def handle_errors(fn):
    """Bad input: one clear line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DetauditError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except CellFailed as e:  # a worker crashed where no sweep goes on past it (a benchmark): not bad input
            err.print(f"[bold red]failed:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]: completed cells are kept; rerun the same command to resume")
            raise typer.Exit(130) from None

    return wrapper


def _flags_take_no_value(params: list) -> list:
    """typer's help shows every option's type, a flag's as `<bool>` as if it took a value: an empty
    metavar shows nothing there (a flag's on / off forms say what it does)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


HELP_TEXT_MIN = 30  # columns rich's help layout must leave for the help text beside the option names


def _help_width() -> int:
    """The width typer's rich help renders at: TERMINAL_WIDTH, else the terminal's (COLUMNS; 80 off one)."""
    width = os.environ.get("TERMINAL_WIDTH")
    return Console(width=int(width) if width and width.isdigit() else None).width


def _rich_help_fits(params: list, width: int) -> bool:
    """Whether typer's rich help shows every option name whole at `width`. Its table gives each kind of
    name its own column (long, short, --no-... long and short, type, help) as wide as its widest entry; when
    they leave the help text less than HELP_TEXT_MIN columns, rich cuts the names with an ellipsis."""
    columns = [0, 0, 0, 0, 0]
    for p in params:
        if getattr(p, "param_type_name", "") != "option" or getattr(p, "hidden", False):
            continue
        names = (
            [o for o in p.opts if o.startswith("--")],
            [o for o in p.opts if not o.startswith("--")],
            [o for o in p.secondary_opts if o.startswith("--")],
            [o for o in p.secondary_opts if not o.startswith("--")],
            [p.metavar if p.metavar is not None else "<float>"],  # the widest of typer's value types
        )
        columns = [max(c, len(",".join(n))) for c, n in zip(columns, names)]
    return sum(columns) + 2 * (len(columns) + 1) + 4 + HELP_TEXT_MIN <= width  # padding, panel borders


class Command(TyperCommand):
    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))

    def format_help(self, ctx, formatter):
        """typer's rich panels where they fit; on a narrower terminal (80 columns and `sweep`'s
        --apply-chat-template / --no-apply-chat-template) click's plain layout, grouped by the same
        panels, which puts a long name on its own line instead of cutting it."""
        if _rich_help_fits(self.get_params(ctx), _help_width()):
            return super().format_help(ctx, formatter)
        return super(TyperCommand, self).format_help(ctx, formatter)  # click's: usage, text, format_options

    def format_options(self, ctx, formatter):
        arguments, panels = [], {}
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is None:
                continue
            if p.param_type_name == "argument":
                arguments.append(record)
            else:
                panels.setdefault(getattr(p, "rich_help_panel", None) or "options", []).append(record)
        for title, records in (("arguments", arguments), *panels.items()):
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class Group(TyperGroup):
    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))


class App(typer.Typer):
    """A typer app whose groups and commands show flags without a value placeholder."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("cls", Group)
        super().__init__(**kwargs)

    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)


def _finite(obj):
    """NaN / inf (e.g. metrics of a backend with no completed cell) become null: strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False) + "\n")


def print_rows(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(Text(str(r.get(c, ""))) for c in columns))  # data, not markup
    out.print(table)


def print_listing(rows: list[dict], columns: list[str], json_: bool, title: str | None = None) -> None:
    print_json(rows) if json_ else print_rows(rows, columns, title)


def command_line() -> str:
    return "detaudit " + " ".join(shlex.quote(a) for a in sys.argv[1:])


class Dtype(str, Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"


class TpMode(str, Enum):
    real = "real"
    emulated = "emulated"


def out_path(text: str) -> Path:
    """The parser of options naming a path to write (-o, --junit): typer would read '' as '.' (the working
    directory); that and a name no filesystem takes are usage errors, before any work."""
    from detaudit.paths import check_output_path

    try:
        return check_output_path(text)
    except DetauditError as e:
        raise typer.BadParameter(str(e)) from None


# ---- options declared once
JsonOpt = Annotated[bool, typer.Option("--json", help="Output as JSON.")]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help=(
            "Named model (see `models ls`), a local HF checkpoint directory, or a hub id (from the local HF cache; "
            "online where a network exists)."
        ),
        rich_help_panel="model and suites",
    ),
]
DataDirOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--data-dir",
        envvar="DETAUDIT_DATA_DIR",
        help="Local suite mirror holding aime24.jsonl / amc23.jsonl (no dataset hub needed).",
        rich_help_panel="model and suites",
    ),
]
LimitOpt = Annotated[
    Optional[int],
    typer.Option("--limit", "-L", help="Only the first N prompts of each suite.", rich_help_panel="model and suites"),
]
TrustSuitePathsOpt = Annotated[
    bool,
    typer.Option(
        "--trust-suite-paths",
        help=(
            "Let suite files read outside their own directory (absolute, ../ or symlinked include / data_files / "
            "data_dir, a local dataset_path, file:// URLs) and a --data-dir file be a symlink to elsewhere; "
            "recorded in the manifest."
        ),
        rich_help_panel="model and suites",
    ),
]
BackendsOpt = Annotated[
    str, typer.Option("--backends", "-b", help="Comma-separated backends (see `backends ls`).", rich_help_panel="grid")
]
TpModeOpt = Annotated[
    TpMode,
    typer.Option(
        "--tp-mode",
        help="real: one process per rank; emulated: one process computes every rank's partials.",
        rich_help_panel="grid",
    ),
]
DtypeOpt = Annotated[
    Dtype, typer.Option("--dtype", help="bfloat16 (as deployments run) or float32.", rich_help_panel="engine")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda.", rich_help_panel="engine")]
MaxNewTokensOpt = Annotated[
    int,
    typer.Option(
        "--max-new-tokens",
        help="Tokens generated per prompt (given, it wins over a suite's generation_kwargs.max_gen_toks).",
        rich_help_panel="decoding",
    ),
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", rich_help_panel="decoding")]
TopPOpt = Annotated[float, typer.Option("--top-p", rich_help_panel="decoding")]
TopKOpt = Annotated[int, typer.Option("--top-k", rich_help_panel="decoding")]
SeedOpt = Annotated[int, typer.Option("--seed", rich_help_panel="decoding")]
GreedyOpt = Annotated[
    bool, typer.Option("--greedy", help="Greedy decoding instead of seeded sampling.", rich_help_panel="decoding")
]
OutputOpt = Annotated[
    Path,
    typer.Option("--output-path", "-o", help="Directory to write.", rich_help_panel="data and output", parser=out_path),
]
SaveOpt = Annotated[Optional[Path], typer.Option("--save", help="Also write the table (.md or .csv).")]
RunDirArg = Annotated[
    Path,
    typer.Argument(
        help="A run directory written by `detaudit sweep`, or an alignment directory written by `detaudit align`."
    ),
]


def decoding(
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    max_new_tokens: int,
    greedy: bool = False,
    logprobs: int = SAMPLING.logprobs,
) -> DecodingParams:
    if (
        greedy
        and temperature != 0
        and (temperature, top_p, top_k) != (SAMPLING.temperature, SAMPLING.top_p, SAMPLING.top_k)
    ):
        raise DetauditError(
            "conflicting flags: --greedy decodes without sampling; drop --temperature/--top-p/--top-k or --greedy"
        )
    return DecodingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
        greedy=greedy,
        logprobs=logprobs,
    )
