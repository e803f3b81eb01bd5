"""Which decode batch sizes get a CUDA graph by default (pure arithmetic, no GPU needed)."""

from fastllm.compile.cuda_graphs import MAX_DEFAULT_CAPTURE_SIZE, default_capture_sizes


def test_default_sizes_are_powers_of_two_then_every_eight():
    assert default_capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))


def test_max_num_seqs_is_captured_even_off_the_grid():
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_capture_stops_at_the_cap():
    sizes = default_capture_sizes(1024)
    assert sizes[-1] == MAX_DEFAULT_CAPTURE_SIZE == 512
    assert sizes == default_capture_sizes(512)
