import time

import torch

from writescope.engine.timing import synchronize, synchronized_seconds


def test_synchronized_seconds_returns_the_result_and_the_wall_time():
    out, s = synchronized_seconds(lambda: (time.sleep(0.02), 7)[1], torch.device("cpu"))
    assert out == 7
    assert 0.02 <= s < 5.0


def test_synchronize_without_cuda_is_a_no_op():
    synchronize(torch.device("cpu"))  # must not touch torch.cuda on a CPU build
