"""row_lookups: embedding lookups rewritten to gather their rows where the table lies (CUDA), and the way
such a table comes in."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import fx, nn

from fxoffload_hf.loaders import LoadSpec, Way, way_of
from fxoffload_hf.row_lookups import gather_on_host, gather_rows
from fxoffload_hf.safetensors_io import read_header
from fxoffload_hf.weight_record import WeightRecord


class _Lookups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(50, 8, padding_idx=0)
        self.positions = nn.Embedding(16, 8, max_norm=1.0)  # renormalises the rows it reads: writes the table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1])
        return self.tokens(ids) + torch.embedding(self.tokens.weight, ids) + self.positions(positions)


def test_lookups_of_the_given_tables_become_row_gathers_with_equal_results() -> None:
    torch.manual_seed(0)
    module = _Lookups().eval()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        expected = module(ids)
    inlined = _inline_embeddings(module)
    tables = {n for n in inlined.graph.nodes if n.op == "get_attr" and n.target.endswith(".weight")}
    assert len(tables) == 2
    assert gather_on_host(inlined, tables) == 2  # not the lookup with ``max_norm``
    targets = [n.target for n in inlined.graph.nodes if n.op == "call_function"]
    assert targets.count(gather_rows) == 2
    assert torch.nn.functional.embedding in targets  # the positions' lookup, left as it was
    with torch.no_grad():
        assert torch.equal(inlined(ids), expected)


def _inline_embeddings(module: nn.Module) -> fx.GraphModule:
    """``module`` traced with its ``nn.Embedding``s as calls of ``F.embedding`` on their tables, as a
    graph dynamo captures shows them."""

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return False

    return fx.GraphModule(module, Tracer().trace(module))


def test_a_table_read_by_rows_on_cuda_stays_where_it_lies(tmp_path) -> None:
    table = torch.randn(50, 8)
    save_file({"t": table}, tmp_path / "t.safetensors")
    from_file = WeightRecord("t", (50, 8), torch.float32, disk=read_header(tmp_path / "t.safetensors")["t"])
    in_ram = WeightRecord("h", (50, 8), torch.float32, host=table)
    assert way_of(in_ram, "cuda", rows_only=True) is Way.ROWS
    assert way_of(from_file, "cuda", rows_only=True) is Way.MAPPED
    assert way_of(in_ram, "cuda") is Way.COPIED and way_of(from_file, "cuda") is Way.STAGED
    spec = LoadSpec.build([in_ram, from_file], "cuda", frozenset({"t", "h"}), side=0)
    assert (spec.rows, spec.mapped, spec.copied, spec.staged) == ((in_ram,), (from_file,), (), ())
    assert spec.streamed_bytes == 0  # neither is brought in whole
