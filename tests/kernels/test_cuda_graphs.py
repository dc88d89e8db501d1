"""On a GPU, codecs capture into a CUDA graph and replay to the same result (issue 26,
item 6): no host sync, no data-dependent allocation and no Python-side randomness in an
encode or decode. Stochastic codecs key their random bits by the codec state's call count,
which the graph advances on the device, so a replay from the same state gives the same
codes. Skipped without CUDA."""
import pytest
import torch

from llm_act.codecs import make_codec

pytestmark = pytest.mark.gpu

CODECS = ["int4", "int8", "int2", "int4_asym", "int4_channel", "outlier_int4", "dual2",
          "fp8_e4m3", "fp8_e5m2", "bitmask"]


@pytest.mark.parametrize("name", CODECS)
def test_encode_decode_replays_in_a_cuda_graph(name):
    codec = make_codec(name)
    x = torch.randn(512, 2, 256, device="cuda", dtype=torch.bfloat16)
    if name == "bitmask":  # a 0/1 mask: lossless, no side list
        x = (x > 0).to(torch.bfloat16)
    else:
        x.view(-1)[[7, 9000]] = float("nan")  # the side list is filled inside the graph too
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile kernels, make the codec's state
        codec.decode(codec.encode(x))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = codec.decode(codec.encode(x))
    state = codec.state(x.device).clone()
    graph.replay()
    first = y.clone()
    codec.state(x.device).copy_(state)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first.view(torch.int16), y.view(torch.int16))
    assert torch.equal(torch.isnan(first), torch.isnan(x))
    if not codec.stochastic:  # the graph computes what eager computes
        eager = codec.decode(codec.encode(x))
        assert torch.equal(eager.view(torch.int16), first.view(torch.int16))
