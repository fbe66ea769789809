"""The ``posenc`` command: ``list``, ``compare``, ``analyze``, ``bench``, ``extend``, ``study``.

Each subcommand other than ``list`` lives in its own package and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them up.

Every error a user can cause is one line on stderr: a bad flag value (argparse, through
:class:`posenc.cli_types.OneLineParser`) and output that cannot be written exit with
status 2, Ctrl-C with 130; no traceback. SIGTERM (``kill``, a scheduler stopping the job)
is handled as Ctrl-C is, the same line (and ``compare``'s resume hint), with status 143.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from ._version import __version__
from .cli_types import OneLineParser
from .registry import available as _available
from .registry import get_class, options_of

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("posenc.compare.cli", "train small models per encoding; quality and length extrapolation"),
    "analyze": ("posenc.analysis.cli", "properties of encodings: decomposition, invariance, decay, ..."),
    "bench": ("posenc.bench.cli", "speed and memory of each encoding against references"),
    "extend": ("posenc.extend.cli", "a trained checkpoint past its training length, per training-free method"),
    "study": ("posenc.studies.cli", "the paper studies' commands over finished compare runs"),
}


def encoding_rows() -> list[dict[str, str]]:
    """One row per registered encoding, grouped by kind (in the order position enters
    attention, :data:`KIND_ORDER`), then by name: the data behind ``posenc list`` and the
    README table."""
    rows = []
    for name in _available():
        cls = get_class(name)
        # properties may depend on options; report the defaults of a small instance
        enc = cls(heads=2, head_dim=8, max_len=16, causal=True)
        rows.append(
            {
                "name": name,
                "kind": cls.kind,
                "stages": ", ".join(cls.stages.names()) or "none",
                "relative": "yes" if enc.relative else "no",
                "extrapolates": "yes" if enc.extrapolates else "no",
                # coordinates per position: 1 for a sequence; grids via the `axes` option or fixed
                "axes": "1 (option `axes`)" if "axes" in options_of(cls) else str(enc.needs.axes),
                "paper": cls.paper,
                "year": str(cls.year),
            }
        )
    return sorted(rows, key=lambda r: (KIND_ORDER.index(r["kind"]), r["name"]))


# the kinds (posenc.contract.kind_of) in the order position enters attention
KIND_ORDER = ("none", "input", "qk", "bias", "terms", "scores", "hidden", "normaliser")
COLUMNS = ("name", "kind", "stages", "relative", "extrapolates", "axes", "paper", "year")


def encodings_table(rows: list[dict[str, str]], columns=COLUMNS, title: str | None = None):
    """The rows as a :class:`posenc.output.Table` (names as code in Markdown)."""
    from .output import Column, Table

    cols = [Column(c, code=c == "name") for c in columns]
    title = f"posenc: {len(rows)} encodings" if title is None else title
    return Table(cols, [[r[c] for c in columns] for r in rows], title=title)


def markdown_table(rows: list[dict[str, str]]) -> str:
    """The README's encodings table (``posenc list --format markdown``)."""
    return encodings_table(rows, title="").markdown().rstrip("\n")


def cmd_list(args: argparse.Namespace) -> int:
    rows = encoding_rows()
    if args.format == "markdown":
        print(markdown_table(rows))
        return 0
    if args.options:
        for r in rows:
            r["options"] = ", ".join(options_of(get_class(r["name"])))
    encodings_table(rows, COLUMNS + (("options",) if args.options else ())).print()
    presets_table().print()
    return 0


def presets_table():
    """The layer presets (:data:`posenc.PRESETS`): name, model, pattern, source."""
    from .output import Column, Table
    from .patterns import PRESETS

    cols = [Column("preset", code=True), Column("model"), Column("pattern", code=True), Column("source")]
    rows = [[p.name, f"{p.model} ({p.year})", p.pattern, p.source] for p in PRESETS.values()]
    return Table(cols, rows, title=f"{len(rows)} layer presets (encoding=NAME, posenc.layers(NAME))")


def make_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="posenc", description="Transformer position encodings: use, compare, understand.")
    p.add_argument("--version", action="version", version=f"posenc {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("list", help="table of every registered encoding and layer preset")
    pl.add_argument("--format", choices=("table", "markdown"), default="table")
    pl.add_argument("--options", action="store_true", help="also list each encoding's options")
    pl.set_defaults(func=cmd_list)
    for name, (module, help_) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0])
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser().parse_args(argv)
    args.argv = argv  # the command as given, for the records a tool writes (compare's report.md)
    prog = f"posenc {args.command}"
    out = sys.stdout = _Watched(sys.stdout)
    terminated: list[int] = []
    before = _sigterm_as_ctrl_c(terminated)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a full or closed stdout shows here, not at interpreter exit
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (files written so far are complete; nothing half-written is left)", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:  # `posenc list | head`: the reader left; say nothing
        _silence_stdout()
        return 1
    except OSError as e:  # stdout on a full disk (`posenc list > /dev/full`), a file the system refused
        if out.failed:
            _silence_stdout()
            print(f"{prog}: error: cannot write to standard output: {e.strerror or e}", file=sys.stderr)
        else:
            where = f" ({str(e.filename)!r})" if e.filename else ""
            print(f"{prog}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    finally:
        if sys.stdout is out:
            sys.stdout = out.stream
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    return 143 if terminated and rc == 130 else rc  # a tool's own "interrupted" (130) after a SIGTERM


def _sigterm_as_ctrl_c(terminated: list[int]):
    """Handle SIGTERM as Ctrl-C is: the SIGINT handler in place runs (a file being written is
    finished first, :func:`posenc.output.hold_ctrl_c`), so each tool says it was interrupted
    and how to go on; ``terminated`` records the signal (exit 143, not 130). Returns the handler
    replaced (None off the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigterm(signum, frame):
        terminated.append(signum)
        ctrl_c = signal.getsignal(signal.SIGINT)
        if not callable(ctrl_c):  # SIGINT ignored (a background job) or not Python's: stop all the same
            raise KeyboardInterrupt
        ctrl_c(signal.SIGINT, frame)

    return signal.signal(signal.SIGTERM, on_sigterm)


class _Watched:
    """``sys.stdout`` as it was, noting whether writing to it failed (every other attribute
    is the stream's own): a failed write is then said as one, not as some other error."""

    def __init__(self, stream) -> None:
        self.stream, self.failed = stream, False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())
