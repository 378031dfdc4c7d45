"""The receiver's receive buffers in the init plan: what init/transport.py allocates while a stream arrives."""

import itertools

import pytest

from twinkle_strategy.init.send_pool import FLAG_BYTES
from twinkle_strategy.init.transport import bucket_sizes
from twinkle_strategy.planning.plan import receive_buffers

MiB = 1 << 20


@pytest.mark.parametrize("stream", [1, 100 * MiB, 256 * MiB, 257 * MiB, 600 * MiB, 512 * MiB])
def test_p2p_holds_the_two_largest_consecutive_buckets(stream):
    """_receive_p2p posts the next bucket's buffer before it unpacks the last: two are alive at once."""
    sizes = bucket_sizes(stream, 256 * MiB)
    alive = max((a + b + 2 * FLAG_BYTES for a, b in itertools.pairwise(sizes)), default=sizes[0] + FLAG_BYTES)
    assert receive_buffers(stream, bucket_bytes=256 * MiB, transport="p2p", receivers=3) == alive


def test_scatter_holds_two_rounds_of_a_share_of_the_bucket():
    share = 256 * MiB // 3
    assert receive_buffers(600 * MiB, bucket_bytes=256 * MiB, transport="scatter", receivers=3) == \
        2 * (share + FLAG_BYTES)
    assert receive_buffers(10, bucket_bytes=256 * MiB, transport="scatter", receivers=3) == 10 + FLAG_BYTES


def test_nothing_to_receive_holds_nothing():
    assert receive_buffers(0, bucket_bytes=MiB, transport="p2p", receivers=3) == 0
    assert receive_buffers(5 * MiB, bucket_bytes=MiB, transport="p2p", receivers=0) == 0
