"""Ray's runtime packed small enough to travel to the lent GPU machine (`make gpu-wheels` calls this).

    python benchmarks/ray_pack.py RAY_WHEEL OUT.tar.xz

Ray's wheel (76 MiB) does not fit beside the other wheels under the 64 MiB that travel with the work tree: what
``RemoteLearner`` uses (the core runtime) is kept, the Java jars, RLlib, Data, Serve, Tune, Train, the LLM library
and the dashboard's web build are left out, and the rest is packed with xz (about 20 MiB), the wheel's file modes
kept (the binaries stay executable). `make gpu-site` unpacks it beside the wheels.
"""
from __future__ import annotations

import io
import lzma
import os
import sys
import tarfile
import time
import zipfile

UNUSED = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/llm/", "ray/tune/", "ray/train/",
          "ray/dashboard/client/")


def pack(wheel: str, out: str) -> int:
    """Writes ``out`` (a .tar.xz) from the wheel's files less ``UNUSED``; returns the bytes written."""
    with zipfile.ZipFile(wheel) as zf, lzma.open(out, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for entry in zf.infolist():
            if entry.is_dir() or entry.filename.startswith(UNUSED):
                continue
            data = zf.read(entry)
            info = tarfile.TarInfo(entry.filename)
            info.size = len(data)
            info.mode = (entry.external_attr >> 16) & 0o777 or 0o644
            info.mtime = time.mktime(entry.date_time + (0, 0, -1))
            tar.addfile(info, io.BytesIO(data))
    return os.path.getsize(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1].strip())
    size = pack(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: {size / 2**20:.1f} MiB")
