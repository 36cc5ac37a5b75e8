"""A tile's product is exact in its columns, and computes alone only where that was seen to round as the
whole weight's product does for the same kernel key."""

from __future__ import annotations

import pytest
import torch

from fxoffload_hf import tile_products, tiles


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch) -> None:
    monkeypatch.setattr(tile_products, "_verdicts", {})


def _tiled(x: torch.Tensor, weight: torch.Tensor, per_tile: int) -> torch.Tensor:
    filled = None
    for start, stop in tiles.tile_ranges(weight.shape[0], per_tile):
        filled = tile_products.tile_linear(x, weight[start:stop], None, start, weight.shape[0], filled)
    assert filled is not None
    return filled


def _counting_whole_shaped(monkeypatch) -> list[int]:
    calls: list[int] = []
    whole_shaped = tile_products._whole_shaped_product

    def counted(*args):
        calls.append(args[3])
        return whole_shaped(*args)

    monkeypatch.setattr(tile_products, "_whole_shaped_product", counted)
    return calls


# odd tiles of a matrix-vector product (MKL rounds an odd tail apart), even ones, a batch of tokens
@pytest.mark.parametrize(
    ("rows", "cols", "tokens", "per_tile"), [(8009, 256, 1, 1001), (8000, 256, 1, 1008), (4099, 64, 5, 1024)]
)
def test_the_verdict_is_what_the_tile_alone_computes(
    rows: int, cols: int, tokens: int, per_tile: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(rows, cols, generator=gen), torch.randn(1, tokens, cols, generator=gen)
    whole = torch.nn.functional.linear(x, weight)
    for _ in range(2):  # learning, then using what was learned
        assert torch.equal(_tiled(x, weight, per_tile), whole)
    for start, stop in tiles.tile_ranges(rows, per_tile):
        tile = weight[start:stop]
        alone = torch.equal(torch.nn.functional.linear(x, tile), whole[..., start:stop])
        assert tile_products.alone_is_exact(x, tile, None, start, rows) is alone


def test_a_tile_seen_exact_alone_is_computed_alone(monkeypatch) -> None:
    weight, x = torch.randn(4096, 128), torch.randn(1, 3, 128)
    whole_shaped = _counting_whole_shaped(monkeypatch)
    exact = {True: 0, False: 0}
    for start in range(0, 4096, 1024):
        tile_products._verdicts[
            tile_products._kernel_key(x, weight[start : start + 1024], None, start, 4096)
        ] = True
        exact[True] += 1
    assert torch.equal(_tiled(x, weight, 1024), torch.nn.functional.linear(x, weight))
    assert whole_shaped == []


def test_a_tile_seen_inexact_alone_keeps_the_whole_shape(monkeypatch) -> None:
    weight, x = torch.randn(4096, 128), torch.randn(1, 3, 128)
    whole_shaped = _counting_whole_shaped(monkeypatch)
    for start in range(0, 4096, 1024):
        key = tile_products._kernel_key(x, weight[start : start + 1024], None, start, 4096)
        tile_products._verdicts[key] = False
    assert torch.equal(_tiled(x, weight, 1024), torch.nn.functional.linear(x, weight))
    assert whole_shaped == [0, 1024, 2048, 3072]


def test_inputs_that_cannot_tell_summation_orders_apart_decide_nothing() -> None:
    weight = torch.randn(2048, 256)
    x = torch.zeros(1, 2, 256)
    x[..., :3] = 1.0  # sums of three terms
    assert torch.equal(_tiled(x, weight, 1024), torch.nn.functional.linear(x, weight))
    assert tile_products._verdicts == {}


def test_another_kernel_key_is_learned_apart() -> None:
    weight = torch.randn(2048, 256)
    one, batch = torch.randn(1, 1, 256), torch.randn(1, 7, 256)
    _tiled(one, weight, 1024)
    assert tile_products.alone_is_exact(batch, weight[:1024], None, 0, 2048) is None
    _tiled(batch, weight, 1024)
    assert tile_products.alone_is_exact(batch, weight[:1024], None, 0, 2048) is not None
    assert len(tile_products._verdicts) == 4
