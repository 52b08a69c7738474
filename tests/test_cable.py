"""CABLE against its authors' formula, and the identity with FoX's gate that its docstring states."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posenc.encodings import build


def test_the_bias_is_the_authors_cumulative_negative_softplus() -> None:
    torch.manual_seed(0)
    cable = build("cable", num_heads=3, head_dim=4)
    with torch.no_grad():
        cable.step_weight.normal_(0, 0.5)
        cable.step_bias.normal_(0, 1.0)
    x = torch.randn(2, 9, 12)
    pos = torch.arange(9)
    got = cable.content_bias(None, torch.zeros(2, 3, 9, 4), pos, pos, features=cable.token_features(x))
    b = torch.cumsum(-F.softplus(x @ cable.step_weight.T + cable.step_bias), dim=1).permute(0, 2, 1)  # (B, H, T)
    expected = b[..., :, None] - b[..., None, :]
    causal = torch.ones(9, 9).tril().bool()
    torch.testing.assert_close(got[..., causal], expected[..., causal])
    assert (got[..., causal] <= 0).all()


def test_it_is_foxs_gate_with_the_weights_negated() -> None:
    torch.manual_seed(1)
    cable, fox = build("cable", num_heads=2, head_dim=4), build("fox", num_heads=2, head_dim=4)
    with torch.no_grad():
        fox.gate_weight.copy_(-cable.step_weight)
        fox.gate_bias.copy_(-cable.step_bias + 0.3)
        cable.step_bias.sub_(0.3)
    x = torch.randn(1, 7, 8)
    torch.testing.assert_close(cable.token_features(x), fox.token_features(x))
