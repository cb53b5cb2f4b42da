"""``turnstream export --kind messages`` of conversations that show images (issue 39, point 5), as
a real process over real shards and a real nats-server holding the images: the Parquet export
loads in Hugging Face ``datasets`` with PIL images in an ``images`` column and ``{"type":
"image"}`` where each sat; what it cannot do (JSON Lines, no log, an image the log lost) is
one clear error and no dataset."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest
from PIL import Image

from consumers import fold
from eventlog import JetStreamImageStore
from schemas.events import TrajectoryReady
from schemas.images import content_digest
from schemas.shards import ShardMetadata, trajectories_to_table
from shardstore import FileShardStore
from tests.conftest import Log
from tests.helpers.image_sessions import png, put_images, with_images
from tests.helpers.sessions import append_only, session_events
from tests.helpers.trajectories import folded

pytestmark = pytest.mark.integration

JSON = dict[str, Any]
RUN = "r1"
SCREEN = [png(1, 64, 48), png(2, 32, 40)]


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", "export", "--kind", "messages", "--run", RUN,
         "--no-fidelity", *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip


def seeing(session: str, shown: dict[int, bytes]) -> TrajectoryReady:
    events = session_events(append_only(3), run=RUN, session=session)
    [trajectory] = fold(with_images(events, shown)).trajectories
    return trajectory


@pytest.fixture
def shards(tmp_path: Path) -> tuple[Path, list[TrajectoryReady]]:
    """Run r1: a session shown an image at turns 0 and 2, one shown the same screenshot twice,
    and one that saw none."""
    rows = [
        seeing("two", {0: SCREEN[0], 2: SCREEN[1]}),
        seeing("resent", {0: SCREEN[1], 1: SCREEN[1]}),
        folded(RUN, "text"),
    ]
    root = tmp_path / "data" / "shards"
    items = list(enumerate(rows, start=1))
    meta = ShardMetadata(
        run=RUN, stream="TRAJ", stream_created="t", first_seq=1, last_seq=len(rows),
        rows=len(rows), fold_versions=(rows[0].fold_version,),
    )  # fmt: skip
    FileShardStore(str(root)).write(trajectories_to_table(items, meta), meta)
    return root, rows


async def test_images_load_as_pil_images_where_the_messages_show_them(
    log: Log, shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path
) -> None:
    root, _ = shards
    await put_images(await JetStreamImageStore.open(log.nc, log.settings), SCREEN)
    out = tmp_path / "out"

    done = await asyncio.to_thread(
        export, "--shards", str(root), "--log.url", log.server.url, "-o", str(out)
    )

    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["images"] == {"rows": 2, "count": 4}
    card = (out / "README.md").read_text()
    assert "  - name: images\n    list: image\n" in card
    loaded = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert isinstance(loaded.features["images"], datasets.List)
    assert isinstance(loaded.features["images"].feature, datasets.Image)
    rows = {row["session"]: row for row in loaded}
    two = rows["two"]
    assert [image.size for image in two["images"]] == [(64, 48), (32, 40)]
    assert all(isinstance(image, Image.Image) for image in two["images"])
    first = two["messages"][0]
    assert (first["role"], first["content"]) == (
        "user",
        [{"type": "image", "text": None}, {"type": "text", "text": "obs 0"}],
    )
    assert two["messages"][1]["content"] == [{"type": "text", "text": "reply 0"}]
    assert two["messages"][4]["content"][0] == {"type": "image", "text": None}
    assert len(rows["resent"]["images"]) == 2 and rows["text"]["images"] == []
    # The bytes are the client's, as stored; the path names them as the log does.
    raw = pq.read_table(out / "data").to_pylist()
    stored = next(r for r in raw if r["session"] == "two")["images"]
    assert [i["bytes"] for i in stored] == SCREEN
    assert [i["path"] for i in stored] == [f"sha256:{content_digest(d)}" for d in SCREEN]
    with Image.open(io.BytesIO(stored[0]["bytes"])) as image:
        assert image.format == "PNG"

    # A --where leaving only the text session: the text layout, no log needed.
    text_only = await asyncio.to_thread(
        export, "--shards", str(root), "--where", "session = 'text'", "-o", str(tmp_path / "t")
    )
    assert text_only.returncode == 0, text_only.stderr
    assert "images" not in pq.read_table(tmp_path / "t" / "data").column_names


async def test_what_cannot_be_exported_with_images_is_refused_clearly(
    log: Log, shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path
) -> None:
    root, _ = shards
    out = tmp_path / "out"

    as_jsonl = await asyncio.to_thread(
        export, "--shards", str(root), "--log.url", log.server.url, "--format", "jsonl",
        "-o", str(out),
    )  # fmt: skip
    assert as_jsonl.returncode == 1
    assert "JSON Lines has no image type" in as_jsonl.stderr
    assert "--format parquet" in as_jsonl.stderr

    offline = await asyncio.to_thread(
        export, "--shards", str(root), "--data-dir", str(tmp_path / "elsewhere"), "-o", str(out)
    )
    assert offline.returncode == 1
    assert "has no log" in offline.stderr and "--log.url" in offline.stderr

    await put_images(await JetStreamImageStore.open(log.nc, log.settings), SCREEN[:1])
    lost = await asyncio.to_thread(
        export, "--shards", str(root), "--log.url", log.server.url, "-o", str(out)
    )
    assert lost.returncode == 1
    assert f"image sha256:{content_digest(SCREEN[1])} is not in the log's image" in lost.stderr
    assert not out.exists()
