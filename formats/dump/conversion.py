"""kdtr-dump convert SRC DST: KDTR <-> HDF5, safetensors -> either (docs/KDTR_DUMP.md,
"Conversion").
"""
from __future__ import annotations

import os

from ..console import UsageError, refuse_existing, writing
from ..progress import ProgressBar
from .output import EXIT_OK, escape
from .sources import detect_format, open_source


# ----------------------------------------------------------------------------- convert

_H5_EXT = (".h5", ".hdf5", ".he5", ".hdf")


def convert(args, out: list[str]) -> int:
    from ..hdf5 import from_hdf5, to_hdf5
    from ..safetensors_io import safetensors_to_hdf5, safetensors_to_kdtr
    src_fmt = detect_format(args.src)
    dst = args.dst.lower()
    dst_fmt = "hdf5" if dst.endswith(_H5_EXT) else "kdtr" if dst.endswith(".kdtr") else None
    if dst_fmt is None:
        raise UsageError(f"{escape(args.dst)}: DST must end in .kdtr or one of "
                         f"{', '.join(_H5_EXT)} (safetensors is read, never written)")
    if src_fmt == dst_fmt:
        raise UsageError(f"{escape(args.src)} is already {src_fmt}")
    if os.path.isdir(args.dst):
        raise UsageError(f"{escape(args.dst)}: is a folder; DST names the file to write")
    if os.path.exists(args.dst) and os.path.samefile(args.src, args.dst):
        raise UsageError("SRC and DST are the same file")
    refuse_existing(args.dst, args.force)
    bar = ProgressBar("convert", force=args.progress)
    try:
        with writing(args.dst):
            if src_fmt == "kdtr":
                to_hdf5(args.src, args.dst, progress=bar)
            elif src_fmt == "hdf5":
                from_hdf5(args.src, args.dst, progress=bar)
            elif dst_fmt == "kdtr":
                safetensors_to_kdtr(args.src, args.dst, split_dots=args.split_dots,
                                    progress=bar)
            else:
                safetensors_to_hdf5(args.src, args.dst, split_dots=args.split_dots,
                                    progress=bar)
    finally:
        bar.close()
    with open_source(args.dst) as check:
        entries = check.entries()
    n = sum(1 for e in entries if e.kind == "dataset")
    size = sum(e.nbytes or 0 for e in entries if e.kind == "dataset")
    out.append(f"wrote {escape(args.dst)} ({dst_fmt}): {n} datasets, {size:,} bytes of data "
               f"from {escape(args.src)} ({src_fmt})")
    return EXIT_OK
