"""bench.quality's int8 rounding rows: the weights rounded in place to int8 times a bfloat16 scale
per output channel or per group of inputs, so that the row measures that rounding alone."""

import torch
from torch import nn

from bench.quality import round_to_int8
from models.kernels.linear import Linear


class Tiny(nn.Module):
    """What quantized_linears walks: decoder layers of linears, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].proj = Linear(128, 64, bias=False)
        self.layers[0].odd = Linear(96, 64, bias=False)  # 96 inputs: no group of 64 divides it
        self.lm_head = Linear(128, 32, bias=False)
        with torch.no_grad():
            self.layers[0].proj.weight.mul_(torch.logspace(-2, 1, 128))  # ranges differ by input
            self.layers[0].proj.weight[3, 70] = 40.0  # one outlier in one group of channel 3


def _error(group: int) -> tuple[torch.Tensor, Tiny, torch.Tensor]:
    """|rounded - original| of the layer's weight [64, 128], the model, the original."""
    model = Tiny()
    before = model.layers[0].proj.weight.detach().clone()
    storage = model.layers[0].proj.weight.data_ptr()
    round_to_int8(model, group)
    after = model.layers[0].proj.weight
    assert after.data_ptr() == storage  # in place: the native decode step's pointers hold
    return (after - before).abs(), model, before


def test_rounding_is_int8_times_a_bfloat16_scale_per_group():
    for group in (0, 64, 32):
        _, model, before = _error(group)
        w = model.layers[0].proj.weight.detach().float()
        width = group or 128
        blocks = before.reshape(64, 128 // width, width)
        scale = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.bfloat16).float()
        q = w.reshape(64, 128 // width, width) / scale
        assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 127
        assert (w.reshape_as(blocks) - blocks).abs().le(scale / 2 * 1.001).all()


def test_a_scale_per_group_isolates_an_outlier():
    per_channel, _, _ = _error(0)
    per_group, _, _ = _error(64)
    # channel 3's outlier (input 70) sets its whole scale per channel, per 64 inputs only that
    # of inputs 64 .. 127: its inputs 0 .. 63 come out far finer
    assert per_group[3, :64].max() < per_channel[3, :64].max() / 10
    assert (per_group.max(dim=1).values <= per_channel.max(dim=1).values * 1.001).all()


def test_a_linear_the_group_does_not_divide_is_left_and_the_head_is_rounded():
    model = Tiny()
    odd, head = model.layers[0].odd.weight.detach().clone(), model.lm_head.weight.detach().clone()
    round_to_int8(model, 64)
    assert torch.equal(model.layers[0].odd.weight, odd)
    assert not torch.equal(model.lm_head.weight, head)
