"""How every console script of the project reports bad input: one line, exit 2 (issue 16).

    from formats.console import (ArgumentParser, UsageError, add_debug_flag,
                                 refuse_existing, run_console, writing)

    def _main(argv: list[str]) -> int:
        parser = ArgumentParser(prog="kdtr-thing")    # its errors: one line, exit 2
        add_debug_flag(parser)                       # shows --debug in --help
        args = parser.parse_args(argv)
        if args.budget < 1:
            raise UsageError(f"--budget {args.budget}: must be at least 1")
        refuse_existing(args.out, args.force)        # an existing output needs --force
        with writing(args.out):                      # a full disk: one line naming it
            ...
        return 0

    def main(argv: list[str] | None = None) -> int:  # the console_scripts entry point
        return run_console("kdtr-thing", _main, argv)

``run_console`` turns *expected* failures, those caused by what the user gave, into one line
``PROG: error: MESSAGE`` on stderr and exit code 2: a ``UsageError`` (raised by the script for
a bad option or value), a ``KdtrError`` (a malformed or hostile input file; its message names
the rule, the node and, where known, the file), an ``OSError`` about a path (missing file,
directory, permission, a missing output folder), a ``UnicodeDecodeError`` (a binary file where
text was wanted), a full disk (ENOSPC, EDQUOT, EFBIG).  Ctrl-C is one line and exit 130.  A
reader that goes away (``kdtree-run | head -c 20``) ends the script quietly with exit 141,
what a shell reports for a process killed by SIGPIPE (``yes | head``).  Anything else is a
bug: it propagates with its traceback (exit 1).  ``--debug`` anywhere on the command line
(taken out before the script sees its arguments) or ``KDTREE_DEBUG=1`` in the environment
re-raises expected failures too, so that their traceback shows.

``ArgumentParser``'s errors (an unknown option, a bad choice, a missing argument) are the same
one line and exit 2, not argparse's usage block; ``--help`` stays full.  ``refuse_existing``
keeps an output file from being replaced without ``--force``; ``writing(path)`` turns a full
disk while writing ``path`` (also as h5py reports it) into one line naming ``path``; the
writers remove their partial output (they write a temporary file and rename it into place
when complete).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys
from typing import Any, Callable, Iterator

from .errors import KdtrError

__all__ = ["UsageError", "run_console", "add_debug_flag", "split_debug", "debug_from_env",
           "error_message", "is_expected", "escape", "read_user_text", "ArgumentParser",
           "refuse_existing", "writing", "full_disk_errno", "DEBUG_FLAG", "DEBUG_ENV",
           "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_PIPE"]

DEBUG_FLAG = "--debug"
DEBUG_ENV = "KDTREE_DEBUG"
EXIT_USAGE = 2          # argparse's code for a usage error; ours for every bad input
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_PIPE = 141         # 128 + SIGPIPE (13), what a shell reports for `yes | head`'s yes

# OSErrors that mean "the path the user named is wrong", not "the machine is broken".
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
                FileExistsError)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP)
# A write that ran out of room: the disk, the quota, or the largest file allowed.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# h5py reports the C library's errno inside its message ("... errno = 28, error message =
# 'No space left on device' ..."), and on a failed close as a RuntimeError without .errno.
_H5_ERRNO = re.compile(r"\berrno = (\d+)")


class UsageError(ValueError):
    """Bad input from the user.  The message names the file, option or value at fault and
    what would be right (``--budget 0: must be at least 1``); ``run_console`` prints it as
    ``PROG: error: MESSAGE`` and exits 2."""


def escape(text: Any, backslash: bool = True) -> str:
    """``text`` made safe for a terminal: every non-printable character (C0, DEL, C1
    controls, ANSI escapes, newlines) and every format/bidi/separator character (U+202E,
    U+2066, U+200B, U+FEFF, tag characters, ...) become repr-style escapes (``\\x1b``,
    ``\\u202e``), and a backslash is doubled so that escapes stay unambiguous.  Printable
    text, including non-ASCII letters, is kept.  ``backslash=False`` leaves backslashes alone:
    for error messages whose file-derived parts are already ``ascii()``-quoted."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and ("\\" not in s or not backslash):
        return s
    out = []
    for ch in s:
        if ch == "\\" and backslash:
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def add_debug_flag(parser) -> None:
    """Declare ``--debug`` on an argparse parser so that ``--help`` lists it.  The flag itself
    is consumed by ``run_console`` before the parser runs."""
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help=f"on an error, show the full traceback instead of one line "
                             f"(also: {DEBUG_ENV}=1 in the environment)")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are ``UsageError``: ``run_console`` prints them as the
    one line ``PROG: error: MESSAGE`` (exit 2) every other bad input gets, instead of
    argparse's usage block.  ``--help`` is argparse's, in full."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def refuse_existing(path, force: bool) -> None:
    """Before any work: an output file that exists is replaced only with ``--force``
    (``UsageError`` naming it otherwise, so nothing is written or removed)."""
    if not force and os.path.lexists(path):
        raise UsageError(f"{os.fsdecode(path)}: already exists; --force replaces it")


def full_disk_errno(exc: BaseException | None) -> int | None:
    """The errno (ENOSPC, EDQUOT or EFBIG) when ``exc``, or an exception it was raised while
    handling, says a write ran out of room; None otherwise.  h5py's own errors count: its
    OSError carries the errno, the RuntimeError of the close that follows only its text."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = exc.errno if isinstance(exc, OSError) else None
        if code is None and isinstance(exc, (OSError, RuntimeError)):
            found = _H5_ERRNO.search(str(exc))
            code = int(found.group(1)) if found else None
        if code in _NO_ROOM:
            return code
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def writing(path) -> Iterator[None]:
    """Within the block, a full disk while writing the output ``path`` (``full_disk_errno``)
    becomes one ``OSError`` naming ``path`` (``run_console``: one line, exit 2).  The writers
    (``formats.kdtr.File``, ``formats.hdf5``) write a temporary file beside ``path`` and
    remove it on any error, so no partial output is left and a file ``path`` already held
    is untouched."""
    try:
        yield
    except Exception as e:
        code = full_disk_errno(e)
        if code is None:
            raise
        reason = _os_message(OSError(code, os.strerror(code)))
        raise OSError(code, f"{reason} while writing it; the partial output was removed",
                      os.fspath(path)) from e


def split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (before a ``--`` separator) and whether it was there."""
    rest, debug, literal = [], False, False
    for a in argv:
        if a == "--" and not literal:
            literal = True
        elif a == DEBUG_FLAG and not literal:
            debug = True
            continue
        rest.append(a)
    return rest, debug


def debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_expected(exc: BaseException) -> bool:
    """Whether ``exc`` is a bad-input failure (one line, exit 2) rather than a bug."""
    if isinstance(exc, (UsageError, KdtrError, UnicodeDecodeError)):
        return True
    if isinstance(exc, OSError):
        return (isinstance(exc, _PATH_ERRORS) or exc.filename is not None
                or exc.errno in _FULL)
    return False


def error_message(exc: BaseException) -> str:
    """The one-line text for an expected failure (see ``is_expected``), escaped."""
    if isinstance(exc, OSError) and not isinstance(exc, UnicodeDecodeError):
        text = _os_message(exc)
    elif isinstance(exc, UnicodeDecodeError):
        text = (f"not {exc.encoding} text: byte 0x{exc.object[exc.start]:02x} at offset "
                f"{exc.start} ({exc.reason}); a text file was expected")
    elif isinstance(exc, KdtrError) and exc.file is not None:
        text = f"{exc.file}: {exc.describe(with_file=False)}"   # the file first, like OSError
    else:
        text = str(exc) or type(exc).__name__
    # backslash=False: KDTR messages already ascii()-quote what came from a file.
    return escape(text, backslash=False)


def _os_message(exc: OSError) -> str:
    plain = {errno.ENOENT: "no such file or folder", errno.EISDIR: "is a folder, not a file",
             errno.ENOTDIR: "a part of the path is not a folder",
             errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.EEXIST: "already exists", errno.ENOSPC: "no space left on the device",
             errno.EDQUOT: "over the disk quota", errno.EFBIG: "file too large"}
    reason = exc.strerror or str(exc)
    if exc.errno in plain and exc.strerror == os.strerror(exc.errno):
        reason = plain[exc.errno]   # a reason written for us (not the C library's) is kept
    if exc.filename is None:
        return reason
    names = os.fsdecode(exc.filename)
    if exc.filename2 is not None:
        names += f" -> {os.fsdecode(exc.filename2)}"
    return f"{names}: {reason}"


def read_user_text(path: str, option: str | None = None) -> str:
    """The UTF-8 text of a file the user named (``option``, e.g. ``--prompt-file``, says
    where): a missing, unreadable or binary file raises ``UsageError`` naming both."""
    where = f"{option} {path}" if option else str(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: {error_message(e)}") from e
    except OSError as e:
        raise UsageError(f"{where}: {_os_message(e).split(': ', 1)[-1]}") from e


def _say(prog: str, text: str) -> None:
    try:
        sys.stderr.write(f"{prog}: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass   # stderr closed: nothing left to tell


def _drop_stdout() -> None:
    """The reader of stdout went away: point the process's stdout at /dev/null, so that what
    is still buffered goes nowhere at exit instead of raising again there ("Exception ignored
    ... BrokenPipeError", exit 120).  Any other stdout (a test's capture) is left alone."""
    try:
        fd = sys.stdout.fileno()
        if sys.__stdout__ is None or fd != sys.__stdout__.fileno():
            return
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def run_console(prog: str, main: Callable[[list[str]], int],
                argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv`` defaults to ``sys.argv[1:]``, ``--debug`` taken out) and
    return its exit code.  Expected failures (see the module docstring) print one line
    ``PROG: error: MESSAGE`` to stderr and return 2; Ctrl-C prints ``PROG: interrupted`` and
    returns 130; a closed stdout (``BrokenPipeError``) returns 141 without a word;
    ``SystemExit`` (argparse's --help) returns its code; other exceptions propagate.  With
    ``--debug`` or ``KDTREE_DEBUG=1`` every exception but a closed pipe propagates."""
    argv, debug = split_debug(list(sys.argv[1:] if argv is None else argv))
    debug = debug or debug_from_env()
    try:
        code = main(argv)
        sys.stdout.flush()   # here, not at exit, so that a reader gone away is seen below
        return code
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_PIPE
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        _say(prog, str(e.code).removeprefix(f"{prog}: "))   # sys.exit("message"): exit 1
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        _say(prog, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug or not is_expected(e):
            raise
        _say(prog, "error: " + error_message(e))
        return EXIT_USAGE
