"""The kdtr-dump command line: argument parsing, dispatch to the commands, error reporting
and the exit code (``main`` is the console script's entry point)."""
from __future__ import annotations

import sys

from ..console import ArgumentParser, add_debug_flag, refuse_existing, run_console, writing
from .comparison import diff
from .conversion import convert
from .inspection import inspect
from .output import EXIT_OK, escape


# ----------------------------------------------------------------------------- CLI

def _inspect_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kdtr-dump", description="Inspect a .kdtr, .h5 or .safetensors file. Other "
        "commands: 'kdtr-dump diff A B', 'kdtr-dump convert SRC DST' (see --help of each).")
    p.add_argument("file", nargs="?", help="the file to inspect")
    p.add_argument("-a", "--attrs", action="store_true", help="show attribute values")
    p.add_argument("--stats", action="store_true",
                   help="min/max/mean/std/absmax and NaN/Inf/zero counts per dataset")
    p.add_argument("-d", "--dataset", metavar="PATH", help="print the values of one dataset")
    p.add_argument("--slice", metavar="SEL", help='with -d: a selection like "0:4,:8"')
    p.add_argument("-f", "--filter", action="append", metavar="GLOB",
                   help="only paths matching GLOB (fnmatch; repeatable)")
    p.add_argument("--summary", action="store_true",
                   help="counts, parameters, bytes per dtype and per top-level entry, "
                        "numbered components collapsed")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    p.add_argument("--offsets", action="store_true", help="show file offsets of datasets")
    p.add_argument("--verify", action="store_true",
                   help="check every checksum; exit 0 intact, 3 corrupt, 2 unreadable")
    p.add_argument("--progress", action="store_true",
                   help="progress bar on stderr even when it is not a terminal")
    p.add_argument("--sample", metavar="OUT", help="write the sample model to OUT and exit")
    p.add_argument("--force", action="store_true", help="with --sample: replace OUT if it exists")
    add_debug_flag(p)
    return p


def _diff_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kdtr-dump diff", description="Compare two files "
                                "(any of .kdtr, .h5, .safetensors). Exit 0 same, 1 differ, "
                                "2 error.")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance, times |B| (default 0)")
    p.add_argument("--json", action="store_true")
    add_debug_flag(p)
    return p


def _convert_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kdtr-dump convert", description="Convert between .kdtr "
                                "and .h5; .safetensors as input. DST's extension picks the "
                                "output format.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--split-dots", action="store_true",
                   help="safetensors input: turn '.' in tensor names into '/' (groups)")
    p.add_argument("--progress", action="store_true",
                   help="progress bar on stderr even when it is not a terminal")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    add_debug_flag(p)
    return p


def _run(argv: list[str], out: list[str]) -> int:
    if argv and argv[0] == "diff":
        return diff(_diff_parser().parse_args(argv[1:]), out)
    if argv and argv[0] == "convert":
        return convert(_convert_parser().parse_args(argv[1:]), out)
    parser = _inspect_parser()
    args = parser.parse_args(argv)
    if args.sample:
        from ..sample import write_sample
        refuse_existing(args.sample, args.force)
        with writing(args.sample):
            write_sample(args.sample)
        out.append(f"wrote {escape(args.sample)}")
        return EXIT_OK
    if not args.file:
        parser.error("a FILE is needed (or --sample OUT)")
    if args.slice and not args.dataset:
        parser.error("--slice goes with -d PATH")
    if args.force:
        parser.error("--force goes with --sample OUT (convert takes its own)")
    return inspect(args, out)


def main(argv: list[str] | None = None) -> int:
    """The ``kdtr-dump`` entry point; returns the exit code.  Bad input (a missing, damaged or
    foreign file, a bad option) is one line on stderr naming the file and exit 2
    (``formats.console.run_console``); ``--debug`` or ``KDTREE_DEBUG=1`` shows the traceback."""
    return run_console("kdtr-dump", _main, argv)


def _main(argv: list[str]) -> int:
    out: list[str] = []
    try:
        return _run(argv, out)
    finally:   # what was produced before an error still goes out, ahead of the error line
        _emit(out)


def _emit(lines: list[str]) -> None:
    if not lines:
        return
    text = "\n".join(lines) + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()   # a reader gone away (`| head`): run_console ends quietly, 141
    except UnicodeEncodeError:
        sys.stdout.write(text.encode("ascii", "backslashreplace").decode("ascii"))
