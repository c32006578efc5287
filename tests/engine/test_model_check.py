"""The initial broadcast (engine/compat/model_check.py): bounded messages, never a copy of the
whole model."""

import torch
import torch.distributed as dist

from dpscale.engine.compat.model_check import BROADCAST_BUCKET_BYTES, broadcast_coalesced


class _RecordingGroup:
    """A hand-made group whose broadcast records what it was given (rank 0's view: nothing changes)."""

    def __init__(self):
        self.sent = []

    def broadcast(self, tensors, opts):
        self.sent.append(tensors[0])

        class Done:
            def wait(self, timeout):
                return True

        return Done()


def test_the_broadcast_goes_in_bounded_messages_and_a_large_tensor_in_place():
    # one flat copy of every parameter would double the model's memory at the peak (torch's DDP
    # sends 250 MiB messages); here messages of at most 64 bytes, a larger tensor on its own
    small = [torch.full((4,), float(i)) for i in range(6)]  # 16 bytes each
    large = torch.arange(40, dtype=torch.float32)  # 160 bytes
    other_dtype = torch.ones(3, dtype=torch.float64)
    group = _RecordingGroup()
    broadcast_coalesced([*small[:3], large, *small[3:], other_dtype], group, bucket_bytes=64)
    sizes = [(t.numel(), t.dtype) for t in group.sent]
    assert sizes == [(12, torch.float32), (40, torch.float32), (12, torch.float32), (3, torch.float64)]
    assert group.sent[1] is large  # broadcast into the parameter itself: no copy
    assert all(t.numel() * t.element_size() <= 64 for t in group.sent if t is not large)
    assert BROADCAST_BUCKET_BYTES == 250 * 1024 * 1024


def test_the_broadcast_copies_rank_0s_values_into_every_tensor():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensors = [torch.randn(3, 2), torch.randn(5).t(), torch.randn(7)]
        before = [t.clone() for t in tensors]
        broadcast_coalesced(tensors, dist.group.WORLD, bucket_bytes=40)
        assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))
    finally:
        dist.destroy_process_group()
