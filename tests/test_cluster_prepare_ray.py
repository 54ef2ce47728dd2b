"""`agentrl.cluster.prepare_ray` on a local Ray cluster of simulated nodes, with plain processes in
place of the conversion (the real conversion across two simulated nodes is in
tests/test_cluster_prepare.py): a node whose process fails stops the others and is named with its
log; a node whose copy fails is named, the others still copy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.cluster.actors import ProcessSpec
from agentrl.cluster.prepare import ModelCheckpointError

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray cluster of 2 simulated nodes for the module (each start costs seconds here);
    every `PrepareCluster` below places its own group in it and removes it."""
    from agentrl.cluster.prepare_ray import init_local_ray

    init_local_ray(2)
    yield
    ray.shutdown()


def _no_groups_left() -> bool:
    return all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


@pytest.mark.slow
def test_a_failing_node_stops_the_other_nodes_and_is_named_with_its_log(
    local_ray: None, tmp_path: Path
) -> None:
    from agentrl.cluster.prepare_ray import PrepareCluster, wait_for_nodes

    logs = tmp_path / "logs"
    specs = [
        ProcessSpec("node-0", "convert", 0, ("sleep", "300")),  # a rank waiting for its peers
        ProcessSpec("node-1", "convert", 1, ("sh", "-c", "echo rank 1 cannot read its shard >&2; exit 3")),
    ]
    with PrepareCluster([0, 1], 2, local=True) as c:
        actors = {s.node: c.spawn(s, logs) for s in specs}
        pid = ray.get(actors[0].status.remote(), timeout=60)["pid"]
        with pytest.raises(
            ModelCheckpointError, match=r"job failed on node-01 \(exit 3\); the other nodes are stopped"
        ) as e:
            wait_for_nodes(actors, what="job", log_dir=logs, timeout_s=120, poll_s=0.5)
        assert "rank 1 cannot read its shard" in str(e.value) and "--- node-00" in str(e.value)
    assert _no_groups_left() and ray.util.list_named_actors() == []
    assert not os.path.exists(f"/proc/{pid}")  # the waiting node's process was stopped with its actor


@pytest.mark.slow
def test_prepare_cp_names_the_node_that_failed_and_the_others_still_copy(
    local_ray: None, tmp_path: Path
) -> None:
    from agentrl.cluster.prepare_ray import copy_to_nodes

    root, local = tmp_path / "shared", tmp_path / "local"
    (root / "megatron" / "m" / "model").mkdir(parents=True)
    (root / "megatron" / "m" / "model" / "metadata.json").write_text("{}")
    needs = {0: ["megatron"], 1: ["fp8"]}  # nothing was quantised: node 1 cannot copy
    with pytest.raises(
        ModelCheckpointError,
        match=r"failed on node-01: .*fp8/m does not exist: run `prepare` first.*copied on: node-00",
    ):
        copy_to_nodes(needs, root=root, local_root=local, model_name="m", num_nodes=2, local=True)
    assert (local / "node-00" / "megatron" / "m" / "model" / "metadata.json").read_text() == "{}"
    assert not (local / "node-01").exists()
    assert _no_groups_left()
