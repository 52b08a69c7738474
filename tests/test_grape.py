"""GRAPE's two forms against the authors' formulas, written out here, and their stated special cases."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from posenc.encodings import build
from posenc.encodings.alibi import alibi_slopes


def test_grape_m_starts_as_rope_and_its_frequencies_train() -> None:
    torch.manual_seed(0)
    grape, rope = build("grape_m", num_heads=2, head_dim=8), build("rope", num_heads=2, head_dim=8)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    pos = torch.arange(50, 56)
    for got, expected in zip(grape.rotate(q, k, pos, pos), rope.rotate(q, k, pos, pos), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    q.requires_grad_()
    rq, rk = grape.rotate(q, k, pos, pos)
    (rq * rk).sum().backward()
    assert grape.log_freq.grad is not None and grape.log_freq.grad.abs().sum() > 0


def test_grape_m_is_relative_at_any_learned_spectrum() -> None:
    torch.manual_seed(1)
    grape = build("grape_m", num_heads=3, head_dim=8, share_across_heads=False)
    with torch.no_grad():
        grape.log_freq.add_(torch.randn_like(grape.log_freq) * 8)
    q, k = torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8)
    near, far = torch.arange(5), torch.arange(1000, 1005)
    scores = [torch.einsum("bhmd,bhnd->bhmn", *grape.rotate(q, k, pos, pos)) for pos in (near, far)]
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-3, atol=1e-3)  # fp32 phases at position ~1000


def test_grape_a_is_the_authors_key_gated_bias() -> None:
    torch.manual_seed(2)
    grape = build("grape_a", num_heads=4, head_dim=8)
    with torch.no_grad():
        grape.omega.normal_()
    k = torch.randn(2, 4, 7, 8)
    pos = torch.arange(7)
    got = grape.content_bias(torch.zeros_like(k), k, pos, pos)
    u = grape.u / grape.u.norm(dim=-1, keepdim=True)
    gate = F.softplus((k * u[None, :, None, :]).sum(-1) / math.sqrt(8))  # (B, H, T)
    omega = F.softplus(grape.omega) * torch.tensor(alibi_slopes(4))
    distance = (pos[:, None] - pos[None, :]).clamp(min=0).float()
    expected = -distance * omega[None, :, None, None] * gate[:, :, None, :]
    torch.testing.assert_close(got, expected)


def test_grape_a_with_a_constant_gate_is_alibi_scaled() -> None:
    # u orthogonal to every key: every gate is softplus(0) = log 2, so the bias is ALiBi's at log 2 of its slopes.
    grape, alibi = build("grape_a", num_heads=2, head_dim=4), build("alibi", num_heads=2, head_dim=4)
    with torch.no_grad():
        grape.u.copy_(torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]]))
    k = torch.randn(1, 2, 6, 4)
    k[..., 0] = 0
    pos = torch.arange(6)
    causal = torch.ones(6, 6).tril().bool()
    got = grape.content_bias(torch.zeros_like(k), k, pos, pos)[0][:, causal]
    torch.testing.assert_close(got, math.log(2) * alibi.bias(pos, pos)[:, causal])
