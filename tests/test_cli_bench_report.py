"""bench prefetch reporting: depth recommendation and the PNG plot (synthetic numbers)."""
import pytest

from zero_offload.cli import plot_prefetch, recommend_depth


def result(depth, median, stall):
    return {"depth": depth, "step_time_s": {"median": median, "min": median * 0.95, "max": median * 1.1},
            "stall_s_per_step": stall, "bytes_per_step": {"cpu->gpu": 3e8, "nvme->cpu": 1e8 * depth},
            "peak_bytes": {"gpu": 1e9 + depth * 1e8}}


def test_recommend_smallest_depth_within_tolerance():
    rs = [result(0, 1.00, 0.5), result(1, 0.70, 0.2), result(2, 0.612, 0.01), result(4, 0.60, 0.0),
          result(8, 0.605, 0.0)]
    assert recommend_depth(rs, tolerance=0.03) == 2  # 0.612 <= 0.60 * 1.03
    assert recommend_depth(rs, tolerance=0.01) == 4
    assert recommend_depth(rs, tolerance=0.5) == 1
    with pytest.raises(ValueError):
        recommend_depth([])


def test_plot_writes_a_png(tmp_path):
    rs = [result(d, 1.0 / (1 + d), 0.1 / (1 + d)) for d in (0, 1, 2, 4, 8)]
    rs[0]["stall_s_per_step"] = None  # an engine without stall accounting still plots
    path = tmp_path / "p.png"
    plot_prefetch(rs, path, title="synthetic", recommended=2)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(path).shape
    assert width > height > 300
