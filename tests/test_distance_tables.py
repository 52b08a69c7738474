"""Distance-only biases are read from their (H, L) table on every fast path, with gradients per distance.

Which schemes read a table comes from their declarations (``tables.reads_table``), over the registry: never a list of
names. The per-score formulas (a scheme's ``bias`` and ``score_mod``) are the reference only: here they are made to
raise, and every fast path must still equal ``eager``'s values and gradients computed before. The Triton kernel's
own table path is tested in ``test_triton_table.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, make

import posenc.attention.sdpa as sdpa
from posenc.attention import get_backend
from posenc.attention.tables import distance_mask, plan_gradient, reads_table, tabulate
from posenc.encodings.forms import DerivativeForm

TABLE_SCHEMES = [name for name in SCHEMES if reads_table(make(name))]
STACK = "+".join(TABLE_SCHEMES)  # every distance-only bias of the registry in one scheme


def _run(backend: str, name: str, length: int, grad: bool = True, first: int = 0) -> list[torch.Tensor | None]:
    torch.manual_seed(3)
    enc = make(name)
    pos = torch.arange(first, first + length)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=grad) for _ in range(3))
    with torch.set_grad_enabled(grad):
        rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
        out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos)
        if not grad:
            return [out]
        (out * torch.randn(out.shape)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters() if p.requires_grad)]


def _forbid_formulas(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make every member's per-score formulas raise: a fast path that reads them fails."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a fast path read the scheme's per-score formula instead of its distance table")

    for member in make(name).members:
        monkeypatch.setattr(type(member), "bias", refuse)
        monkeypatch.setattr(type(member), "score_mod", refuse)


def test_the_table_schemes_come_from_declarations() -> None:
    assert TABLE_SCHEMES and all(make(name).distance_only and make(name).adds_bias for name in TABLE_SCHEMES)
    learnable = [name for name in TABLE_SCHEMES if make(name).learnable_bias]
    assert learnable and len(learnable) < len(TABLE_SCHEMES)  # fixed and learnable tables both exercised


@pytest.mark.parametrize("name", [*TABLE_SCHEMES, STACK])
def test_every_fast_path_reads_the_table_and_matches_eager(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # Training: sdpa (CPU flash with the parameters' gradient forms, or the per-distance mask gradient) and
    # flex_learnable; without gradients: flex's and sdpa's forwards. The window starts at 1000: a distance needs none.
    length, first = 40, 1000
    expected = _run("eager", name, length, first=first)
    expected_forward = _run("eager", name, length, grad=False, first=first)
    _forbid_formulas(monkeypatch, name)
    cases = [("sdpa", True), ("sdpa", False), ("flex", False)]
    if make(name).learnable_bias:
        cases.append(("flex_learnable", True))
    for backend, grad in cases:
        got = _run(backend, name, length, grad=grad, first=first)
        for value, reference in zip(got, expected if grad else expected_forward, strict=True):
            torch.testing.assert_close(value, reference, atol=2e-5, rtol=1e-4, msg=f"{backend} grad={grad}")


def test_sdpa_trains_a_table_in_query_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdpa, "MAX_MASK_ELEMENTS", 40 * 13)  # 13 queries a call over the 40 keys of the window
    expected = _run("eager", STACK, 40)
    for value, reference in zip(_run("sdpa", STACK, 40), expected, strict=True):
        torch.testing.assert_close(value, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("queries, keys, offset", [(7, 7, 0), (3, 9, 6), (4, 9, 2)])
def test_mask_gradient_comes_back_one_total_per_distance(queries: int, keys: int, offset: int) -> None:
    # Self-attention, a query suffix (cached decoding), and a chunk of queries in the middle of its keys.
    table = torch.randn(HEADS, keys, requires_grad=True)
    q_pos, k_pos = torch.arange(offset, offset + queries), torch.arange(keys)
    # Future keys get no gradient: the causal mask replaces their bias (and they read distance 0).
    weights = torch.randn(2, HEADS, queries, keys).masked_fill(k_pos[None, :] > q_pos[:, None], 0.0)
    (distance_mask(table, q_pos, k_pos) * weights).sum().backward()
    got, table.grad = table.grad, None
    distance = (q_pos[:, None] - k_pos[None, :]).clamp(min=0)
    (table[:, distance] * weights).sum().backward()
    torch.testing.assert_close(got, table.grad)


@pytest.mark.parametrize("name", [n for n in TABLE_SCHEMES if make(n).learnable_bias])
def test_tabulated_log_factors_are_the_forms_score_mods(name: str) -> None:
    # Identity 1's extra forward reads log f by distance: the table must be the form's score_mod at every (i, j).
    enc, length = make(name), 12
    pos = torch.arange(length, dtype=torch.int32)
    for form in enc.bias_gradient_forms() or []:
        if not isinstance(form, DerivativeForm):
            continue
        table = tabulate(form.log_factor, HEADS, length, "cpu")
        for h in range(HEADS):
            head = torch.tensor(h, dtype=torch.int32)
            for i in range(length):
                row = torch.stack([form.log_factor(torch.zeros(()), head, head, pos[i], pos[j]) for j in range(i + 1)])
                torch.testing.assert_close(row, table[h, : i + 1].flip(0))
    assert plan_gradient(enc, length) is not None
