"""`fused_token_loss`'s Triton path (three products, gradients made in forward) against an fp32
computation from the same bf16 inputs. Skipped without CUDA and Triton; run on the GPU machine.

Bounds: log-probs bit-identical to `fused_logprobs` with the same tiles (one forward kernel); dL/dh
within twice the fp32 reference's own rounding to bf16; a bf16 dL/dW summed over four chunks in
bf16 within four times it; an fp32 weight gradient (fp32 master weights under autocast) within
3e-4; a nonlinear loss equal to autograd through `fused_logprobs`' four-product backward.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from agentrl.algo.fused_logprobs import TileConfig, fused_kernel_available, fused_logprobs
from agentrl.algo.fused_loss import fused_token_loss, vocab_parallel_token_loss
from agentrl.algo.losses import LossConfig
from agentrl.train import forward
from agentrl.train.config import TrainConfig
from agentrl.train.torch_backend import TorchTrainer
from tests.test_fused_logprobs import _free_port
from tests.test_fused_logprobs_cuda import exact_fp32_matmuls, make, reference, rel  # noqa: F401
from tests.test_train_models import make_samples, tiny_base  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not fused_kernel_available("cuda"), reason="needs CUDA and Triton"
)


def linear(g_lp, g_ent):
    """The loss whose gradients are (g_lp, g_ent): what the reference's backward is given."""
    return lambda lp, ent, sl: g_lp[sl] * lp + (g_ent[sl] * ent if ent is not None else 0.0)


def floor(ref):
    return rel(ref.bfloat16(), ref)


@pytest.mark.parametrize("load", ["tma", "ptr"])
@pytest.mark.parametrize(("with_entropy", "temperature"), [(False, 1.0), (True, 0.7)])
def test_fused_loss_log_probs_and_gradients_match_fp32(load, with_entropy, temperature):
    h, w, y, g_lp, g_ent = make(0)
    tiles = TileConfig(load=load)
    lp_ref, ent_ref, dh_ref, dw_ref = reference(h, w, y, g_lp, g_ent, temperature, with_entropy)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    res = fused_token_loss(
        hg, wg, y, linear(g_lp, g_ent), temperature=temperature, with_entropy=with_entropy,
        kernel="triton", tiles=tiles, chunk=256,
    )  # fmt: skip
    res.loss.backward()
    with torch.no_grad():
        lp, ent = fused_logprobs(h, w, y, temperature=temperature, with_entropy=with_entropy, tiles=tiles)
    assert torch.equal(res.logp, lp)
    if with_entropy:
        assert torch.equal(res.entropy, ent)
        assert (res.entropy - ent_ref).abs().max().item() < 1e-4
    want = (g_lp * lp_ref).sum() + ((g_ent * ent_ref).sum() if with_entropy else 0.0)
    assert abs(res.loss.item() - want.item()) <= 1e-4 * want.abs().item() + 1e-2
    assert hg.grad.dtype == torch.bfloat16 and wg.grad.dtype == torch.bfloat16
    assert rel(hg.grad, dh_ref) <= 2 * floor(dh_ref)
    assert rel(wg.grad, dw_ref) <= 4 * floor(dw_ref)


def test_fp32_master_weight_under_autocast_gets_an_fp32_gradient_within_3e4():
    h, w, y, g_lp, g_ent = make(1)
    _, _, dh_ref, dw_ref = reference(h, w, y, g_lp, g_ent, 1.0, True)
    hg, w32 = h.clone().requires_grad_(), w.float().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        res = fused_token_loss(hg, w32, y, linear(g_lp, g_ent), with_entropy=True, chunk=256)
    res.loss.backward()
    assert w32.grad.dtype == torch.float32
    assert rel(w32.grad, dw_ref) <= 3e-4
    assert rel(hg.grad, dh_ref) <= 2 * floor(dh_ref)


def test_a_nonlinear_loss_gets_the_gradients_of_its_fp32_reference():
    """PPO clip with an entropy bonus and an upstream scale: the gradients of the fp32 reference
    given the loss's own per-token gradients at the fp32 log-probs, up to bf16 rounding."""
    h, w, y, _, _ = make(2)
    g = torch.Generator(device="cuda").manual_seed(3)
    adv = torch.randn(y.shape, device="cuda", generator=g)
    old = torch.randn(y.shape, device="cuda", generator=g) - 8

    def ppo(lp, ent, sl=slice(None)):
        r = torch.exp(lp - old[sl])
        return torch.maximum(-adv[sl] * r, -adv[sl] * r.clamp(0.8, 1.28)) - 0.01 * ent

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    res = fused_token_loss(h1, w1, y, ppo, with_entropy=True, chunk=384)
    (res.loss * 0.25).backward()
    lp_ref, ent_ref, _, _ = reference(h, w, y, y * 0.0, y * 0.0, 1.0, True)
    lp_ref, ent_ref = lp_ref.requires_grad_(), ent_ref.requires_grad_()
    g_lp, g_ent = torch.autograd.grad(ppo(lp_ref, ent_ref).sum() * 0.25, [lp_ref, ent_ref])
    _, _, dh_ref, dw_ref = reference(h, w, y, g_lp, g_ent, 1.0, True)
    assert rel(h1.grad, dh_ref) <= 2 * floor(dh_ref)
    assert rel(w1.grad, dw_ref) <= 4 * floor(dw_ref)


@pytest.fixture
def one_rank_group():
    """A one-rank NCCL group on a free port, destroyed afterwards: nothing (no MASTER_PORT, no
    default group) is left for the later tests' own distributed processes to collide with."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_vocabulary_shard_gives_the_fp32_shard_loss(one_rank_group):
    """One rank's shard (targets partly outside it): the Triton path against the torch path in fp32."""
    h, w, y, g_lp, g_ent = make(4)
    shard = w[2000:4000].contiguous()
    out = {}
    for kernel, dtype in (("triton", torch.bfloat16), ("torch", torch.float32)):
        hg = h.detach().to(dtype).clone().requires_grad_()
        sg = shard.detach().to(dtype).clone().requires_grad_()
        res = vocab_parallel_token_loss(
            hg, sg, y, linear(g_lp, g_ent), vocab_start=2000, with_entropy=True, kernel=kernel, chunk=256
        )
        res.loss.backward()
        out[kernel] = (res.logp, res.entropy, hg.grad.float(), sg.grad.float())
    assert ((y < 2000) | (y >= 4000)).any() and ((y >= 2000) & (y < 4000)).any()
    (lp_t, ent_t, dh_t, dw_t), (lp_r, ent_r, dh_r, dw_r) = out["triton"], out["torch"]
    assert (lp_t - lp_r).abs().max().item() < 1e-4
    assert (ent_t - ent_r).abs().max().item() < 1e-4
    assert rel(dh_t, dh_r) <= 2 * floor(dh_r)
    assert rel(dw_t, dw_r) <= 4 * floor(dw_r)


def test_the_trainer_on_cuda_takes_its_step_through_the_fused_loss(tiny_base):  # noqa: F811
    """TorchTrainer on CUDA (fp32 master weights, bf16 autocast) makes its loss with
    `fused_token_loss` by default, and the step matches the chunked path's up to bf16 logits."""
    samples = make_samples(tiny_base, seed=7)
    deltas, losses = {}, {}
    for impl in ("chunked", "auto"):
        cfg = TrainConfig(
            lr=1e-3, weight_decay=0.0, adam_eps=1.0, logprob_impl=impl, loss=LossConfig(entropy_coef=0.01)
        )
        model = copy.deepcopy(tiny_base).float()
        before = torch.cat([p.detach().flatten() for p in model.parameters()]).cuda()
        t = TorchTrainer(model, cfg, device="cuda")
        with mock.patch.object(forward, "fused_token_loss", wraps=forward.fused_token_loss) as spy:
            m = t.train_step(samples)
        assert spy.called == (impl == "auto")
        losses[impl] = m["loss"]
        deltas[impl] = torch.cat([p.detach().flatten() for p in t.model.parameters()]) - before
    assert losses["auto"] == pytest.approx(losses["chunked"], rel=2e-2, abs=1e-4)
    assert rel(deltas["auto"], deltas["chunked"]) < 5e-2
