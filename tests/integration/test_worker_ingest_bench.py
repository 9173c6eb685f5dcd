"""aivedio_tools.bench.media: proxies per minute per CPU unit through the gpu-render worker against plain
ffmpeg running the worker's proxy command line on the same clip, in the same run (a small run)."""
from __future__ import annotations

import pytest

from aivedio_tools.bench.media import bench_media

pytest.importorskip("imageio_ffmpeg")


def test_bench_media_reports_both_throughputs_and_their_ratio():
    report = bench_media(clips=2, rounds=1, resolution="480p", duration_seconds=1)
    assert report["proxies"] == 2 and report["failures"] == 0
    assert report["baseline_ffmpeg"]["proxies"] == 2 and report["baseline_ffmpeg"]["failures"] == 0
    assert report["proxies_per_minute_per_cpu_unit"] > 0 and report["baseline_ffmpeg"]["proxies_per_minute_per_cpu_unit"] > 0
    ratio = report["ratio_vs_ffmpeg"]
    assert ratio == pytest.approx(report["proxies_per_minute_per_cpu_unit"]
                                  / report["baseline_ffmpeg"]["proxies_per_minute_per_cpu_unit"], rel=0.01)
    assert 0 < ratio < 1.5  # the worker does the same encode and more
    assert report["proxy"]["codec"] == "h264" and (report["proxy"]["width"], report["proxy"]["height"]) == (854, 480)
    assert (report["clip"]["width"], report["clip"]["height"], report["cpu_units_per_proxy"]) == (854, 480, 1)
    assert report["encoder"] == "libx264"


def test_bench_media_needs_seconds_or_clips():
    with pytest.raises(ValueError):
        bench_media(seconds=None, clips=None)
