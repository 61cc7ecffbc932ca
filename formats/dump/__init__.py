"""kdtr-dump: inspect, verify, diff and convert KDTR, HDF5 and safetensors files.

    kdtr-dump FILE [-a] [--stats] [--summary] [--json] [-f GLOB]... [--offsets]
    kdtr-dump FILE -d PATH [--slice "0:4,:8"]
    kdtr-dump FILE --verify
    kdtr-dump diff A B [--atol X] [--rtol Y] [--json]
    kdtr-dump convert SRC DST [--split-dots] [--force]
    kdtr-dump --sample OUT [--force]

Exit codes: 0 success (diff: same), 1 diff: files differ, 2 error (unreadable or missing file,
bad arguments, an existing DST without --force, a full disk), 3 --verify: the file is corrupt,
141 the reader of stdout went away (``| head``; no message).  User documentation:
docs/KDTR_DUMP.md.
Every string that comes from a file goes through ``escape`` before it reaches the terminal.

The modules, each importing only those above it: ``output`` (escaping, value and table
formatting, exit codes), ``sources`` (KDTR / HDF5 / safetensors files as one tree of entries
and tensors), ``inspection`` (listing, summary, statistics, previews, --verify),
``comparison`` (diff), ``conversion`` (convert), ``cli`` (argument parsing, ``main``).
Progress bars come from ``formats.progress``.  This package re-exports their public names.
"""
from __future__ import annotations

from ..progress import ProgressBar, human_bytes
from .cli import main
from .comparison import compare_tensors, diff
from .conversion import convert
from .inspection import (PREVIEW_EDGE, PREVIEW_FULL, collapse, compute_stats, inspect,
                         json_node, listing, parse_slice, preview, print_summary, show_dataset,
                         summarize, tensor_stats, verify)
from .output import (EXIT_CORRUPT, EXIT_DIFFER, EXIT_ERROR, EXIT_OK, SCHEMA_VERSION, display_array,
                     escape, fmt_shape, fmt_value, json_float, json_value, table)
from .sources import (HDF5_SIGNATURE, STATS_CHUNK_BYTES, UNREADABLE_CODES, Entry, Hdf5Source,
                      KdtrSource, SafetensorsSource, Source, Tensor, detect_format,
                      normalize_key, open_source, widen)

__all__ = ["main", "escape", "open_source", "detect_format", "preview", "Source", "Entry",
           "Tensor", "KdtrSource", "Hdf5Source", "SafetensorsSource", "tensor_stats",
           "summarize", "compare_tensors", "inspect", "verify", "diff", "convert",
           "ProgressBar", "human_bytes", "collapse", "compute_stats", "json_node", "listing",
           "parse_slice", "print_summary", "show_dataset", "display_array", "fmt_shape",
           "fmt_value", "json_float", "json_value", "table", "normalize_key", "widen",
           "SCHEMA_VERSION", "STATS_CHUNK_BYTES", "PREVIEW_EDGE", "PREVIEW_FULL", "EXIT_OK",
           "EXIT_DIFFER", "EXIT_ERROR", "EXIT_CORRUPT", "UNREADABLE_CODES", "HDF5_SIGNATURE"]
