"""The split gate with O on run 40's DeepSeek-V2-Lite cells (writescope/scheduler/roofline.py
``split_pays``): the H200's calibration and the O, O_link and ring that run's `writescope` rows
placed with. Measured there (benchmarks/results/gpu_decode_h200.md, runs 38-40): streaming alone
won at 4 x 8K and 4 x 16K (45.0 against the split's 47.7 ms a step), the split won at 4 x 32K and
at batch 16 from 8K to 32K. The gate before run 40 split 4 x 16K (r 0.45): it charged streaming
alone a fixed cost that hides behind O and a split no hand-over."""

from __future__ import annotations

import pytest

from writescope.kvcache.spec import Roofline
from writescope.scheduler.roofline import OnlineEstimate, WriteScopePolicy

RUN40 = Roofline(a=1.4879e-08, b=2.0617e-08, c_cpu=5.879e-04, c_gpu=5.505e-04, b_alone=2.0898e-08, c_gpu_alone=2.957e-04)
RING = 116224  # the ping-pong ring's tokens: 2 x 64 MiB of 1,152-byte MLA tokens


class _Other:
    """O as the engine's meter gives it: ``o`` seconds a layer, ``link`` of it on the link."""

    def __init__(self, o: float, link: float):
        self.o, self.l = o, link

    def seconds(self, batch):
        return self.o

    def link(self, batch):
        return self.l

    def in_step_a(self, threads):
        return None


def _share(batch: int, context: int, o: float, link: float, a: float) -> float:
    p = WriteScopePolicy(RUN40)
    p.attach(_Other(o, link), 15, 1, RING)
    p.a = OnlineEstimate(a)
    p.expect_batch(batch)
    return p.cpu_share(context)


@pytest.mark.parametrize("o", [0.42e-3, 0.60e-3, 0.82e-3])  # the O of the two repeats' placement, and above
def test_batch_4_streams_alone_at_8k_and_16k(o):
    assert _share(4, 16384, o, 0.153e-3, 14.88e-9) == 0.0
    assert _share(4, 8192, o, 0.153e-3, 14.88e-9) == 0.0


@pytest.mark.parametrize("o", [0.42e-3, 0.60e-3])
def test_batch_4_splits_at_32k(o):
    assert _share(4, 32768, o, 0.153e-3, 14.88e-9) > 0.4


@pytest.mark.parametrize("context", [8192, 16384, 32768])
def test_batch_16_splits(context):
    assert _share(16, context, 1.07e-3, 0.418e-3, 17.1e-9) > 0.35
