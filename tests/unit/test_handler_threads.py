"""The plugin's gRPC handler threads are started, each with its per-thread setup done
(Celery's result backend object: workers.client.load_result_backend), before the
server takes a call (csi_plugin.server.handler_pool)."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from csi_plugin.server import handler_pool, start_threads

pytestmark = pytest.mark.fast


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.threads: list[int] = []

    def __call__(self):
        with self.lock:
            self.threads.append(threading.get_ident())


def test_every_handler_thread_is_started_and_set_up_before_the_first_task():
    init = Recorder()
    pool = handler_pool(6, init)
    try:
        assert len(init.threads) == 6 and len(set(init.threads)) == 6
        ran = [f.result() for f in [pool.submit(threading.get_ident) for _ in range(50)]]
        assert set(ran) <= set(init.threads)
        assert len(init.threads) == 6            # no thread set up twice, none added later
    finally:
        pool.shutdown()


def test_without_a_setup_threads_start_as_calls_come():
    pool = handler_pool(6)
    try:
        assert len(pool._threads) == 0
    finally:
        pool.shutdown()


def test_start_threads_returns_when_a_thread_is_busy_elsewhere():
    """A pool with a thread already held by a long task: the barrier gives up after its
    timeout and start_threads returns (the plugin starts anyway)."""
    pool = futures.ThreadPoolExecutor(max_workers=3)
    release = threading.Event()
    busy = pool.submit(release.wait)
    try:
        start_threads(pool, 3, timeout=0.2)
        assert len(pool._threads) == 3
    finally:
        release.set()
        busy.result()
        pool.shutdown()


def test_a_grpc_call_runs_in_a_thread_already_set_up(tmp_path):
    """Through a real grpc server on a unix socket, as build_server makes it."""
    init = Recorder()
    seen = []

    def echo(request, context):
        seen.append(threading.get_ident())
        return request

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo, lambda b: b, lambda b: b)})
    server = grpc.server(handler_pool(4, init))
    server.add_generic_rpc_handlers((handler,))
    sock = tmp_path / "s.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            call = ch.unary_unary("/t.T/Echo", request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for _ in range(8):
                assert call(b"x", timeout=10) == b"x"
        assert seen and set(seen) <= set(init.threads)
        assert len(init.threads) == 4
    finally:
        server.stop(None)
