"""The Node watch (driver.kubeletplugin.nodewatch) against the API server double over real HTTP: the Node's
metadata only, one list, then watches resumed from the last resourceVersion; a relist only after 410 Gone."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from driver.kubeletplugin.kubeclient import KubeApiError
from driver.kubeletplugin.nodewatch import NodeMeta, NodeWatch
from driver.simulation.apiserver import FakeApiServer
from tests.support.kubeletplugin import eventually

NODE = "node-a"
NODES = "/api/v1/nodes"


@pytest.fixture
def watches() -> Iterator[list[NodeWatch]]:
    started: list[NodeWatch] = []
    yield started
    for watch in started:
        assert watch.stop()


def test_labels_and_uid_come_from_one_metadata_only_list_then_a_watch_that_sees_changes(
        server: FakeApiServer, watches: list[NodeWatch]) -> None:
    uid = server.add_node(NODE, {"plan": "a"})
    server.add_node("node-b", {"plan": "b"})
    watch = NodeWatch(server.api_client(), NODE)
    watches.append(watch)
    assert watch.sync() == NodeMeta(uid=uid, labels={"plan": "a"})
    seen: list[NodeMeta] = []
    changed = threading.Event()
    watch.add_listener(lambda meta: (seen.append(meta), changed.set()))
    watch.start()
    assert eventually(lambda: any(r[0] == "WATCH" for r in server.requests))
    server.set_node_labels("node-b", {"plan": "c"})  # another node: not ours
    server.set_node_labels(NODE, {"plan": "z"})
    assert changed.wait(10)
    assert seen == [NodeMeta(uid=uid, labels={"plan": "z"})] and watch.meta().labels == {"plan": "z"}
    queries = server.request_queries
    assert [(verb, path) for verb, path, _ in queries] == [("GET", NODES), ("WATCH", NODES)], \
        "never a GET of the whole Node"
    for _, _, query in queries:
        assert query["fieldSelector"] == f"metadata.name={NODE}"
    watch_query = queries[1][2]
    assert watch_query["allowWatchBookmarks"] == "true" and watch_query["resourceVersion"]
    assert int(watch_query["timeoutSeconds"]) >= 300


def test_a_watch_that_the_server_ends_resumes_without_a_list(server: FakeApiServer,
                                                               watches: list[NodeWatch]) -> None:
    server.add_node(NODE, {"plan": "a"})
    watch = NodeWatch(server.api_client(), NODE, min_watch_seconds=1)
    watches.append(watch)
    watch.sync()
    watch.start()
    assert eventually(lambda: len([r for r in server.requests if r[0] == "WATCH"]) >= 3, timeout=20)
    assert [r[0] for r in server.requests].count("GET") == 1, "bookmarks carry the resourceVersion: no relist"


def test_a_watch_too_old_to_resume_lists_again(server: FakeApiServer, watches: list[NodeWatch]) -> None:
    uid = server.add_node(NODE, {"plan": "a"})
    watch = NodeWatch(server.api_client(), NODE, initial_backoff=0.01)
    watches.append(watch)
    watch.sync()
    server.set_node_labels(NODE, {"plan": "b"})
    server.expire_watch_history()  # 410 Gone for the resourceVersion of the list
    watch.start()
    assert eventually(lambda: watch.meta() == NodeMeta(uid=uid, labels={"plan": "b"}))
    assert [r[0] for r in server.requests][:3] == ["GET", "WATCH", "GET"]


def test_no_node_means_no_labels_until_it_appears(server: FakeApiServer, watches: list[NodeWatch]) -> None:
    watch = NodeWatch(server.api_client(), NODE)
    watches.append(watch)
    watch.sync()
    with pytest.raises(KubeApiError) as missing:
        watch.meta()
    assert missing.value.status == 404
    watch.start()
    assert eventually(lambda: any(r[0] == "WATCH" for r in server.requests))
    uid = server.add_node(NODE, {"plan": "a"})
    assert eventually(lambda: watch.uid() == uid)
