"""Directories only this user may enter: where KV bytes live on this host (the shm transport's
files, the disk tier's blocks). A planted link, another user's directory or one open to others
would let someone else read or swap the bytes a worker serves."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def private_dir(d: Path, what: str) -> Path:
    """``d``, created 0700 (and its missing parents) if absent; refused if it is not a directory of
    this user that nobody else can enter (a link, someone else's, or open to others). ``what``
    names it in the error."""
    d.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{what} {d} must be a directory of this user that nobody else can enter "
                              "(mode 0700): remove it, or chmod 700 it, and start again")
    return d
