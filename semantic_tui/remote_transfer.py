"""Agent files between this machine and a server the workbench is attached to: an export written as it
downloads, an import uploaded as it is read. The disk is touched on worker threads only, a chunk at a time,
and an export appears whole or not at all (a temp file beside it, fsync, rename)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import IO, AsyncIterator

import httpx

from engine.store.durable import sync_directory, sync_file
from engine.store.temp_files import temp_prefix

AGENT_FILE_TYPE = "application/octet-stream"
CHUNK = 1 << 20


async def download(response: httpx.Response, final: Path) -> int:
    """The response's body written to ``final``; the bytes written. OSError when the disk refuses (no
    partial file is left)."""
    fd, temp = await asyncio.to_thread(tempfile.mkstemp, prefix=temp_prefix(final.name), suffix=".tmp",
                                       dir=final.parent)
    handle = os.fdopen(fd, "wb")
    written = 0
    try:
        async for chunk in response.aiter_bytes(CHUNK):
            written += await asyncio.to_thread(handle.write, chunk)
        await asyncio.to_thread(_settle, handle, Path(temp), final)
    except BaseException:
        await asyncio.to_thread(_discard, handle, Path(temp))
        raise
    return written


def _settle(handle: IO[bytes], temp: Path, final: Path) -> None:
    handle.flush()
    sync_file(handle.fileno())
    handle.close()
    os.replace(temp, final)
    sync_directory(final.parent)


def _discard(handle: IO[bytes], temp: Path) -> None:
    with suppress(OSError):
        handle.close()
    with suppress(OSError):
        temp.unlink()


async def file_chunks(path: Path) -> AsyncIterator[bytes]:
    """The file's bytes, read on a worker thread a chunk at a time."""
    handle = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(handle.close)
