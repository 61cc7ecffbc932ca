"""Where a file about to be written goes: its folder must exist before a temporary file is
made in it, so that the error names the folder the user gave, not a hidden temporary name."""
from __future__ import annotations

import errno
import os

__all__ = ["output_directory"]


def output_directory(path) -> str:
    """The absolute folder ``path`` will be written in; ``FileNotFoundError`` (or
    ``NotADirectoryError``) naming that folder when it is missing (or not a folder)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        shown = os.path.dirname(path) or directory
        if os.path.exists(directory):
            raise NotADirectoryError(errno.ENOTDIR, f"not a folder (cannot write "
                                                    f"{os.path.basename(path)} in it)", shown)
        raise FileNotFoundError(errno.ENOENT, f"no such folder (cannot write "
                                              f"{os.path.basename(path)} in it)", shown)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"permission denied (cannot write "
                                            f"{os.path.basename(path)} in this folder)",
                              os.path.dirname(path) or directory)
    return directory
