"""Streaming HF checkpoint I/O (`agentrl.train.megatron.hf_io`) and the HF -> Megatron conversion
that reads only each rank's shard of a multi-shard checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402

from agentrl.train.megatron.hf_io import INDEX, HFCheckpoint, HFCheckpointError, HFCheckpointWriter  # noqa: E402
from tests.test_cluster_prepare import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("hf") / "single")


@pytest.fixture(scope="module")
def sharded(single: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as `single`, as save_pretrained writes them in shards of <= 40 KB."""
    out = tmp_path_factory.mktemp("hf") / "sharded"
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_the_mapping_has_every_file_tensor_and_reads_nothing_until_asked(sharded: Path) -> None:
    want = file_tensors(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 10
    with HFCheckpoint(sharded) as hf:
        assert set(hf) == set(want) and len(hf) == len(want)
        assert (
            "model.layers.4.mlp.experts.3.up_proj.weight" in hf
            and "model.layers.4.mlp.experts.4.up_proj.weight" not in hf
        )
        assert hf.shape("model.embed_tokens.weight") == (128, 64)
        assert hf.names_read == set() and hf.bytes_read == 0
        t = hf["model.layers.4.mlp.experts.3.down_proj.weight"]
        assert torch.equal(t, want["model.layers.4.mlp.experts.3.down_proj.weight"])
        assert hf.names_read == {"model.layers.4.mlp.experts.3.down_proj.weight"}
        assert hf.bytes_read == t.numel() * 4
        assert all(torch.equal(hf[k], v) for k, v in want.items())
        assert len(hf._open) <= hf.max_open  # shards are closed again as the reader moves on
        with pytest.raises(KeyError):
            hf["model.layers.9.mlp.gate.weight"]


def test_a_single_file_checkpoint_without_index_reads_the_same(single: Path, sharded: Path) -> None:
    assert not (single / INDEX).exists()
    a, b = HFCheckpoint(single), HFCheckpoint(sharded)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tensors_come_in_the_dtype_asked_for_and_tp_chunks_read_only_their_rows(sharded: Path) -> None:
    hf = HFCheckpoint(sharded, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    full = HFCheckpoint(sharded)[name]
    assert hf[name].dtype == torch.bfloat16 and torch.equal(hf[name], full.to(torch.bfloat16))
    assert hf["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    before = hf.bytes_read
    for dim in (0, 1):
        for rank in range(3):  # uneven chunks too: torch.chunk's sizes
            assert torch.equal(hf.read_chunk(name, dim, rank, 3), full.chunk(3, dim)[rank].to(torch.bfloat16))
    assert hf.bytes_read - before == 2 * full.numel() * 4  # each row / column read once


def test_a_missing_shard_a_corrupt_shard_and_an_absent_tensor_are_typed_errors(
    sharded: Path, tmp_path: Path
) -> None:
    index = json.loads((sharded / INDEX).read_text())
    name = "model.layers.2.self_attn.o_proj.weight"
    shard = index["weight_map"][name]

    def copy(to: Path) -> Path:
        to.mkdir()
        for f in sharded.iterdir():
            (to / f.name).write_bytes(f.read_bytes())
        return to

    missing = copy(tmp_path / "missing")
    (missing / shard).unlink()
    with pytest.raises(HFCheckpointError, match=re.escape(f"{shard}: shard missing")):
        HFCheckpoint(missing)[name]

    corrupt = copy(tmp_path / "corrupt")
    data = (corrupt / shard).read_bytes()
    (corrupt / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(HFCheckpointError, match="not a readable safetensors file"):
        HFCheckpoint(corrupt)[name]

    absent = copy(tmp_path / "absent")
    index["weight_map"]["model.layers.2.self_attn.extra.weight"] = shard
    (absent / INDEX).write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"lacks 1 tensor.*self_attn\.extra\.weight"):
        HFCheckpoint(absent)[name]

    with pytest.raises(HFCheckpointError, match=re.escape("no model.safetensors.index.json and no")):
        HFCheckpoint(tmp_path)


def test_the_writer_streams_bounded_shards_that_transformers_loads(single: Path, tmp_path: Path) -> None:
    src = HFCheckpoint(single)
    out = tmp_path / "export"
    limit = 64 * 1024
    with HFCheckpointWriter(out, max_shard_bytes=limit) as w:
        w.add_all((k, src[k]) for k in src)
    index = json.loads((out / INDEX).read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == len(set(index["weight_map"].values())) > 5
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    biggest = max(t.numel() * t.element_size() for t in file_tensors(single).values())
    for f in shards:
        with safe_open(str(f), framework="pt") as h:
            sizes = [h.get_slice(k).get_shape() for k in h.keys()]
        payload = sum(torch.Size(s).numel() * 4 for s in sizes)
        assert payload <= max(limit, biggest)
    back = HFCheckpoint(out)
    assert set(back) == set(src) and all(torch.equal(back[k], src[k]) for k in src)
    (out / "config.json").write_text((single / "config.json").read_text())
    loaded = transformers.GlmMoeDsaForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    ref = transformers.GlmMoeDsaForCausalLM.from_pretrained(single, dtype=torch.float32).state_dict()
    assert loaded.keys() == ref.keys() and all(torch.equal(loaded[k], ref[k]) for k in ref)


def test_a_failed_export_leaves_no_shards_and_a_name_twice_is_refused(tmp_path: Path) -> None:
    def named():
        for i in range(4):
            yield f"w{i}", torch.ones(64, 64)
        raise RuntimeError("gather failed")

    with (
        pytest.raises(RuntimeError, match="gather failed"),
        HFCheckpointWriter(tmp_path, max_shard_bytes=20_000) as w,
    ):
        w.add_all(named())
    assert list(tmp_path.iterdir()) == []
    w = HFCheckpointWriter(tmp_path / "dup")
    w.add("a", torch.zeros(2))
    with pytest.raises(HFCheckpointError, match="a written twice"):
        w.add("a", torch.zeros(2))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_pipeline_stages_each_read_only_their_own_layers(sharded: Path, tmp_path: Path) -> None:
    """PP=2 (first stage 2 layers, last 3) over gloo in the Megatron environment: each rank builds
    its stage, reads only its layers from the 27-shard checkpoint, and the round trip is exact."""
    from agentrl.cluster.planner import Layout
    from agentrl.cluster.prepare import conversion_ranks, convert_to_megatron
    from tests.megatron_venv import python

    layout = Layout(tp=1, pp=2, cp=1, ep=1, first_stage_layers=2, last_stage_layers=3)
    assert conversion_ranks(layout) == 2
    r = convert_to_megatron(sharded, tmp_path / "megatron", layout, python=str(python()))
    assert r["max_abs_diff"] == 0 and r["ranks"] == 2 and not r["mismatched"]
    assert (
        r["hf_tensors"] == r["checkpoint_tensors"] == len(HFCheckpoint(sharded))
        and r["unconverted_count"] == 0
    )
    first, last = (x["read"] for x in r["per_rank"])
    assert (
        first["layers"] == [0, 1]
        and first["other"] == ["model.embed_tokens.weight"]
        and first["experts"] == []
    )
    assert last["layers"] == [2, 3, 4] and last["other"] == ["lm_head.weight", "model.norm.weight"]
    assert (
        first["tensors"] + last["tensors"] == r["checkpoint_tensors"]
    )  # nothing read twice, nothing skipped
    assert first["bytes"] + last["bytes"] < r["checkpoint_bytes"]
    assert (tmp_path / "megatron" / "model" / "metadata.json").exists()
