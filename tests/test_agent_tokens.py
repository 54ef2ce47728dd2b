"""Token bookkeeping: masks and log-probs stay aligned; prefixes extend or the episode splits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.agent.tokens import ChatRenderer, TokenTrajectory
from tests.chat_tokenizer import THINK_STRIPPING_TEMPLATE, byte_tokenizer

MESSAGES = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"}]


def _turn(traj: TokenTrajectory, text: str, eos: bool, obs: str, version: int = 0) -> None:
    tok = traj.renderer.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    logps = [-0.5 - i * 1e-3 for i in range(len(ids))]
    generated = traj.add_generation(ids, logps, [version])
    traj.add_observation(generated, obs)


def test_renderer_learns_the_text_between_turns() -> None:
    r = ChatRenderer(byte_tokenizer(), observation_role="tool")
    assert r.assistant_close == "<|endoftext|>"
    assert r.observation_prefix == "<|observation|>\n"
    assert r.observation_suffix == "<|assistant|>\n"


def test_tokens_equal_a_full_rendering_and_masks_cover_generated_tokens_only() -> None:
    tok = byte_tokenizer()
    r = ChatRenderer(tok, observation_role="tool")
    traj = TokenTrajectory(r, MESSAGES)
    _turn(traj, '{"cmd": "ls"}', eos=True, obs="a b c")
    _turn(traj, "partial answer cut by len", eos=False, obs="more output")
    seg = traj.current
    assert len(traj.segments) == 1
    full = r.render(traj.messages, add_generation_prompt=True)
    assert seg.prompt_ids + seg.response_ids == tok.encode(full, add_special_tokens=False)
    generated = [i for i, m in zip(seg.response_ids, seg.loss_mask, strict=True) if m]
    expected = (
        tok.encode('{"cmd": "ls"}', add_special_tokens=False)
        + [tok.eos_token_id]
        + tok.encode("partial answer cut by len", add_special_tokens=False)
    )
    assert generated == expected
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if not m)
    assert all(lp < 0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m)


def test_a_template_that_rewrites_history_splits_the_episode_cleanly() -> None:
    tok = byte_tokenizer(THINK_STRIPPING_TEMPLATE)
    r = ChatRenderer(tok)
    traj = TokenTrajectory(r, MESSAGES)
    _turn(traj, "<think>hmm</think>ls", eos=True, obs="out1")
    assert traj.splits == 1 and len(traj.segments) == 2
    first, second = traj.segments
    first.check()
    assert sum(first.loss_mask) == len(first.response_ids)  # only the generated turn, no observation
    assert tok.decode(second.prompt_ids) == r.render(traj.messages, add_generation_prompt=True)
    assert second.response_ids == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.text(max_size=40), st.booleans(), st.text(max_size=60)), min_size=1, max_size=6),
    st.booleans(),
)
def test_alignment_holds_for_any_conversation(turns, think_template: bool) -> None:  # type: ignore[no-untyped-def]
    tok = byte_tokenizer(
        THINK_STRIPPING_TEMPLATE if think_template else byte_tokenizer.__wrapped__.__defaults__[0]
    )
    r = ChatRenderer(tok)
    traj = TokenTrajectory(r, MESSAGES)
    n_generated = 0
    for text, eos, obs in turns:
        n_generated += len(tok.encode(text, add_special_tokens=False)) + int(eos)
        _turn(traj, text, eos, obs)
    for seg in traj.segments:
        seg.check()
        # Each segment spells exactly a rendering of the conversation up to its end.
        assert tok.decode(seg.prompt_ids + seg.response_ids) == seg.text
    assert sum(sum(s.loss_mask) for s in traj.segments) == n_generated
    if traj.splits == 0:
        assert traj.current.text == r.render(traj.messages, add_generation_prompt=True)
