"""The gateway's side of the log's object store: each image put once, before the event naming it.

An agent resends its whole conversation, screenshots included, on every turn; the gateway puts
only a turn's new images (those after the context it continues), and remembers the digests it
stored or found stored, so a screenshot seen before costs no round trip at all. The store itself
is put-if-absent (``eventlog.objects``): a digest this memory forgot is checked, not uploaded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

__all__ = ["ImageObjects", "ImageUploads"]


class ImageObjects(Protocol):
    """The object store port the gateway needs: store bytes under their digest, if absent."""

    async def put(self, data: bytes) -> str: ...


class ImageUploads:
    """Puts images in ``objects``, skipping the ``remember`` digests it stored last."""

    def __init__(self, objects: ImageObjects, remember: int = 4096) -> None:
        self.objects = objects
        self._known: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    async def put(self, data: bytes, digest: str) -> None:
        """Store ``data`` (whose SHA-256 is ``digest``) unless known stored."""
        if digest in self._known:
            self._known.move_to_end(digest)
            return
        await self.objects.put(data)
        self._known[digest] = None
        if len(self._known) > self._remember:
            self._known.popitem(last=False)
