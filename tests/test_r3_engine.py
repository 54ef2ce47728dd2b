"""R3's engine side, as SGLang serves it: the experts each token was routed to (`return_routed_experts`,
`meta_info.routed_experts` base64 int32 [input + output - 1, layers, top_k]) from the local engine,
over HTTP from `agentrl engine serve --enable-return-routed-experts` to the SGLang client, and into
the episode's samples for the trainer's routing replay."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.base import EngineBadRequest, SamplingParams  # noqa: E402
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.routes import decode_routes, encode_routes  # noqa: E402
from agentrl.engine.server import EngineServer  # noqa: E402
from agentrl.engine.sglang import SGLangEngine  # noqa: E402
from agentrl.models.tiny import load_tiny  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def direct_routes(model, tokens: list[int]) -> list[list[list[int]]]:
    """The routers' choices in one plain forward over `tokens` (all but the last), by hand."""
    cfg = model.config
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens[:-1]]))
    finally:
        for h in hooks:
            h.remove()
    k = cfg.num_experts_per_tok
    return [
        [sorted(seen[i][t].tolist()) if i in seen else [-1] * k for i in range(cfg.num_hidden_layers)]
        for t in range(len(tokens) - 1)
    ]


def canonical(routes: list[list[list[int]]]) -> list[list[list[int]]]:
    return [[sorted(layer) for layer in token] for token in routes]


async def test_the_local_engine_returns_each_tokens_experts_batched_with_padding(tiny) -> None:
    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok, return_routed_experts=True, max_batch=4)
    prompts = [[5, 9, 17, 3, 40, 11, 7], [12, 30, 2]]  # different lengths: left padding in one batch
    try:
        gens = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    finally:
        await engine.aclose()
    for prompt, gen in zip(prompts, gens, strict=True):
        routes = gen.routed_experts
        assert routes is not None and len(routes) == len(prompt) + len(gen.output_ids) - 1
        assert all(len(token) == model.config.num_hidden_layers for token in routes)
        dense = model.config.first_k_dense_replace
        assert all(
            token[i] == [-1] * model.config.num_experts_per_tok for token in routes for i in range(dense)
        )
        assert canonical(routes) == direct_routes(model, prompt + gen.output_ids)


async def test_routes_are_refused_where_the_engine_was_not_started_for_them(tiny) -> None:
    engine = LocalEngine(copy.deepcopy(tiny[0]), tiny[1])
    try:
        assert (await engine.generate([5, 9, 17], GREEDY)).routed_experts is None
        with pytest.raises(EngineBadRequest, match="--enable-return-routed-experts"):
            await engine.generate([5, 9, 17], GREEDY, routed_experts=True)
    finally:
        await engine.aclose()


def test_the_wire_format_is_int32_base64_in_c_order() -> None:
    routes = [[[-1, -1], [3, 1]], [[-1, -1], [0, 2]]]
    import base64
    import struct

    assert struct.unpack("<8i", base64.b64decode(encode_routes(routes))) == (-1, -1, 3, 1, -1, -1, 0, 2)
    assert [t[0] for t in decode_routes(encode_routes(routes), 2)] == [[-1, -1, 3, 1], [-1, -1, 0, 2]]
    with pytest.raises(ValueError, match="do not split over 3 tokens"):
        decode_routes(encode_routes(routes), 3)


async def test_over_http_the_client_gets_the_servers_routes(tiny) -> None:
    model, tok = tiny
    prompt = [5, 9, 17, 3, 40, 11]
    engine = LocalEngine(copy.deepcopy(model), tok, return_routed_experts=True)
    async with EngineServer(engine, model_path="tiny", port=0) as server:
        client = SGLangEngine(server.url, retries=2, routed_layers=model.config.num_hidden_layers)
        try:
            gen = await client.generate(prompt, GREEDY)
        finally:
            await client.aclose()
    await engine.aclose()
    assert canonical(gen.routed_experts) == direct_routes(model, prompt + gen.output_ids)

    plain = LocalEngine(copy.deepcopy(model), tok)
    async with EngineServer(plain, model_path="tiny", port=0) as server:
        async with aiohttp.ClientSession() as http:
            r = await http.post(
                f"{server.url}/generate", json={"input_ids": prompt, "return_routed_experts": True}
            )
            assert r.status == 400 and "--enable-return-routed-experts" in await r.text()
    await plain.aclose()


async def test_an_episodes_samples_carry_the_routes_of_their_tokens(tiny) -> None:
    from agentrl.agent.loop import AgentConfig
    from agentrl.agent.tokens import ChatRenderer
    from agentrl.episode.run import EpisodeConfig, SandboxEpisodeRunner
    from agentrl.tasks.dataset import task_row
    from agentrl.tasks.task import load_task
    from agentrl.testing.sandbox import FakeSandboxProvider
    from tests.conftest import BUNDLED_TASKS

    model, tok = tiny
    engine = LocalEngine(copy.deepcopy(model), tok, return_routed_experts=True)
    runner = SandboxEpisodeRunner(
        provider=FakeSandboxProvider(grader=lambda sb: 0.0),
        engine=engine,
        renderer=ChatRenderer.for_format(tok, "fenced-bash"),
        config=EpisodeConfig(
            action_format="fenced-bash",
            agent=AgentConfig(max_turns=1, max_new_tokens=8, max_total_tokens=4000, min_turn_tokens=4),
            sampling=SamplingParams(max_new_tokens=8),
        ),
        run_id="r3",
    )
    try:
        episode = await runner.run(
            task_row(load_task(BUNDLED_TASKS / "hello-file")), group_id="g", sample_index=0
        )
    finally:
        await engine.aclose()
    assert episode.segments, (episode.status, episode.failure_cause, episode.end_reason)
    sample = episode.segments[0]
    # The last generation's routes: every token up to its reply's last (the observation appended
    # after it was never routed by the engine; those positions reach no loss).
    routes = sample.routed_experts
    assert routes is not None and sample.prompt_length < len(routes) < len(sample.tokens) - 1
    assert canonical(routes) == direct_routes(model, sample.tokens[: len(routes) + 1])
    assert all(m == 0 for m in sample.loss_mask[len(routes) + 1 - sample.prompt_length :])
