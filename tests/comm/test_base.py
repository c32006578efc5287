"""comm/base.py: the completed Future that synchronous transports hand out."""

import torch

from dpscale.comm.base import completed


def test_a_completed_future_answers_as_torchs_does():
    x = torch.arange(4.0)
    fut = completed(x)
    assert isinstance(fut, torch.futures.Future)
    assert fut.done()
    assert fut.wait() is x  # answered from Python, without torch's C++ wait
    assert fut.value() is x
    assert torch.equal(fut.then(lambda f: f.value() + 1).wait(), x + 1)
    assert torch.futures.wait_all([fut])[0] is x
