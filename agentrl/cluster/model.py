"""The shape of a mixture-of-experts model as the planner needs it: layer kinds, DSA computing layers and
parameter counts by how they are sharded, read from a Hugging Face `config.json` (a dict). Two
attention kinds: MLA (`kv_lora_rank` in the config: DeepSeek-style, `glm_moe_dsa`, with DSA's
indexer when `index_topk` is there) and grouped-query attention (`num_key_value_heads`: `glm4_moe`).
`ModelEntry` is one model a recipe offers (its name, hub repository and config); the recipes
under `recipes/` hold their own entries, this module names no model.

Pure Python: no transformers, no torch. The DSA rule itself is the Megatron backend's
(`agentrl.train.megatron.plan.indexer_types`), applied to the config, never a list written here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace
from typing import Any

from agentrl.train.megatron.plan import computing_layers, indexer_types


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer by sharding: `tp` split over tensor-parallel ranks, `dup`
    the same on every TP rank (norms, MLA down-projections, indexer, router), `expert` the routed
    experts (split over expert-parallel x expert-TP ranks)."""

    tp: int
    dup: int
    expert: int

    @property
    def total(self) -> int:
        return self.tp + self.dup + self.expert


@dataclass(frozen=True)
class ModelEntry:
    """A model a recipe offers: `config` the fields of its config.json the planner reads (`prepare`
    replaces them with the downloaded config.json and validates that one against `model_type`,
    `architectures` and the layer count). `smoke`: a pruned variant for one-node smoke runs (the
    recipe's small branches: shorter micro-batches, smaller engines, no optimizer offload)."""

    name: str
    hf_repo: str
    config: dict[str, Any] = field(repr=False)
    smoke: bool = False
    tokens_per_gpu: int = 8192  # the layout's token budget per GPU

    def spec(self) -> ModelSpec:
        return ModelSpec(self.name, dict(self.config))


@dataclass(frozen=True)
class ModelSpec:
    """A MoE model's shape (MLA or grouped-query attention, DSA or not), from its HF config dict."""

    name: str
    config: dict[str, Any] = field(repr=False)

    def __getattr__(self, key: str) -> Any:  # config fields as attributes (plan.py reads them so)
        config = self.__dict__.get("config", {})
        if key in config:
            return config[key]
        raise AttributeError(key)

    @property
    def namespace(self) -> SimpleNamespace:
        return SimpleNamespace(**self.config)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def dsa(self) -> bool:
        """DeepSeek Sparse Attention: an indexer on the computing layers (`glm_moe_dsa`)."""
        return "index_topk" in self.config

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (low-rank q / kv projections); else grouped-query attention."""
        return "kv_lora_rank" in self.config

    @cached_property
    def indexer_types(self) -> list[str]:
        """Per layer "full" or "shared" (DSA); without DSA every layer is "full" (any stage split)."""
        return indexer_types(self.namespace) if self.dsa else ["full"] * self.num_layers

    @property
    def computing_layers(self) -> list[int]:
        """1-indexed layers that compute their own DSA top-k (the rest reuse the last one's)."""
        return computing_layers(self.namespace) if self.dsa else list(range(1, self.num_layers + 1))

    def attention_width(self) -> int:
        """Per token, the activation width attention keeps for its backward: q, k, v and the output
        (the MLA form counts k and v at full head width, as its up-projections make them)."""
        c = self.config
        heads = int(c["num_attention_heads"])
        if self.mla:
            qk = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
            return (2 * qk + 2 * int(c["v_head_dim"])) * heads
        hd = self.head_dim
        return 2 * heads * hd + 2 * int(c["num_key_value_heads"]) * hd

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))

    def _attention_params(self) -> tuple[int, int]:
        """(TP-split, duplicated) attention parameters of one layer, norms included."""
        c = self.config
        h, heads = c["hidden_size"], c["num_attention_heads"]
        if not self.mla:
            hd, kv = self.head_dim, c["num_key_value_heads"]
            bias = (heads + 2 * kv) * hd if c.get("attention_bias") else 0
            tp = h * (heads + 2 * kv) * hd + bias + heads * hd * h  # q, k, v (+ biases), o
            dup = 2 * h + (2 * hd if c.get("use_qk_norm") else 0)  # input / post norms, q / k norms
            return tp, dup
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        tp = (
            c["q_lora_rank"] * heads * qk  # q_b_proj
            + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])  # kv_b_proj
            + heads * c["v_head_dim"] * h  # o_proj
        )
        dup = (
            2 * h  # input / post-attention norms
            + h * c["q_lora_rank"]
            + c["q_lora_rank"]  # q_a_proj, q_a_layernorm
            + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
            + c["kv_lora_rank"]  # kv_a_proj_with_mqa, kv_a_layernorm
        )
        return tp, dup

    def lora_params(self, i: int, rank: int) -> int:
        """Parameters of rank-`rank` LoRA adapters on layer `i`'s attention and MLP projections
        (the dense MLP, or the shared experts of a MoE layer; routed experts, the DSA indexer,
        embeddings and the LM head stay frozen): r (in + out) per projection."""
        c = self.config
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        if self.mla:
            qk = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
            q, kv, v = int(c["q_lora_rank"]), int(c["kv_lora_rank"]), int(c["v_head_dim"])
            shapes = [(h, q), (q, heads * qk), (h, kv + int(c["qk_rope_head_dim"])),
                      (kv, heads * (int(c["qk_nope_head_dim"]) + v)), (heads * v, h)]  # fmt: skip
        else:
            hd, kvh = self.head_dim, int(c["num_key_value_heads"])
            shapes = [(h, heads * hd), (h, kvh * hd), (h, kvh * hd), (heads * hd, h)]
        ffn = (
            int(c["moe_intermediate_size"]) * int(c.get("n_shared_experts", 0) or 0)
            if self.moe_layers[i]
            else int(c["intermediate_size"])
        )
        if ffn:
            shapes += [(h, ffn), (h, ffn), (ffn, h)]
        return sum(rank * (a + b) for a, b in shapes)

    @cached_property
    def moe_layers(self) -> list[bool]:
        k = int(self.config.get("first_k_dense_replace", 0))
        return [i >= k for i in range(self.num_layers)]

    @property
    def mtp_layers(self) -> int:
        return int(self.config.get("num_nextn_predict_layers", 0) or 0)

    def layer_params(self, i: int) -> LayerParams:
        """Layer `i` (0-indexed)."""
        c = self.config
        h = c["hidden_size"]
        tp, dup = self._attention_params()
        if self.dsa and self.indexer_types[i] == "full":
            ih, idim = c["index_n_heads"], c["index_head_dim"]
            dup += c["q_lora_rank"] * ih * idim + h * idim + 2 * idim + h * ih
        expert = 0
        if self.moe_layers[i]:
            n, ffn = c["n_routed_experts"], c["moe_intermediate_size"]
            dup += n * h + n  # router weight and expert bias
            tp += c.get("n_shared_experts", 0) * 3 * h * ffn
            expert = n * 3 * h * ffn
        else:
            tp += 3 * h * c["intermediate_size"]
        return LayerParams(tp=tp, dup=dup, expert=expert)

    @property
    def embedding_params(self) -> int:
        return int(self.config["vocab_size"]) * int(self.config["hidden_size"])

    def total_params(self, *, with_mtp: bool = True) -> int:
        """Every weight: decoder layers, embeddings, LM head, final norm (and the MTP layers, each
        one MoE decoder layer plus its projection and norms, when `with_mtp`)."""
        h = int(self.config["hidden_size"])
        total = (
            sum(self.layer_params(i).total for i in range(self.num_layers)) + 2 * self.embedding_params + h
        )
        if with_mtp and self.mtp_layers:
            moe = self.layer_params(self.num_layers - 1)
            total += self.mtp_layers * (moe.total + 2 * h * h + 3 * h)
        return total

    def forward_flops(self, seq_len: int) -> float:
        """Forward FLOPs of one causal sequence of `seq_len` tokens, 2 a multiply-add: every weight a
        token passes through (top-k experts; the input embedding is a lookup), attention's scores
        and weighted values over the positions each token sees (DSA: at most `index_topk`), and the
        DSA indexer's scores over every earlier position on its computing layers. A training step
        is 3x this (the backward's two products a weight), a recomputed forward 1x more."""
        c = self.config
        n = seq_len
        every = n * (n + 1) / 2  # sum over positions of the positions seen, causal
        seen = every
        if self.dsa and n > int(c["index_topk"]):
            k = int(c["index_topk"])
            seen = k * (k + 1) / 2 + (n - k) * k
        if self.mla:
            qk, v = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        else:
            qk = v = self.head_dim
        flops = 2 * (self.active_params() - self.embedding_params) * n
        flops += 2 * int(c["num_attention_heads"]) * (qk + v) * seen * self.num_layers
        if self.dsa:
            flops += (
                2 * int(c["index_n_heads"]) * int(c["index_head_dim"]) * every * len(self.computing_layers)
            )
        return float(flops)

    def active_params(self) -> int:
        """Parameters one token passes through (top-k of the routed experts), without MTP."""
        c = self.config
        total = self.total_params(with_mtp=False)
        per_expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
        idle = c["n_routed_experts"] - c["num_experts_per_tok"]
        return total - sum(self.moe_layers) * idle * per_expert
