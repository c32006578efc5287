"""benchmarks/imagenet_input_rate.py: the measured per-core rate of an ImageNet loader worker's work
(docs/performance-model.md, "Published results") times what it says it times (no process started)."""

import math
import random

import numpy as np
import pytest

pytest.importorskip("PIL")  # the lab extra (matplotlib) brings Pillow
import imagenet_input_rate as rate  # noqa: E402  (benchmarks/ is on sys.path: conftest.py)


def test_the_generated_jpeg_has_the_size_asked_for_and_decodes_to_the_shape():
    import io

    from PIL import Image

    data, quality = rate.encode_near(rate.synthetic_photo(500, 375), 113_000)
    assert abs(len(data) - 113_000) < 0.03 * 113_000 and 50 <= quality <= 98
    assert Image.open(io.BytesIO(data)).size == (500, 375)


def test_crop_boxes_are_randomresizedcrop_boxes():
    rng = random.Random(1)
    boxes = [rate.crop_box(500, 375, rng) for _ in range(2000)]
    for left, top, w, h in boxes:
        assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375
    # area 8-100% and aspect 3/4-4/3 (rounding to whole pixels aside), both sampled over their range
    areas = [w * h / (500 * 375) for _, _, w, h in boxes]
    aspects = [w / h for _, _, w, h in boxes]
    assert 0.075 <= min(areas) < 0.12 and 0.9 < max(areas) <= 1.0
    assert math.isclose(min(aspects), 3 / 4, abs_tol=0.02) and math.isclose(max(aspects), 4 / 3, abs_tol=0.02)
    # a picture too narrow for any sampled box falls back to the centre square
    assert rate.crop_box(10, 1000, random.Random(0)) == (0, 495, 10, 10)


def test_both_pipelines_produce_a_training_sample():
    data, _ = rate.encode_near(rate.synthetic_photo(300, 240, seed=3), 30_000)
    sample = rate.dle_worker(data, random.Random(0))
    assert sample.shape == (224, 224, 3) and sample.dtype == np.uint8
    tensor = rate.torchvision_standard(data, random.Random(0))
    assert tuple(tensor.shape) == (3, 224, 224)
    assert rate.decode_only(data, random.Random(0)).shape == (240, 300, 3)
    # the same crop, normalised: undoing ToTensor + Normalize gives the uint8 sample back
    mean = np.array(rate.MEAN).reshape(3, 1, 1)
    std = np.array(rate.STD).reshape(3, 1, 1)
    back = (tensor.numpy() * std + mean) * 255
    assert np.abs(back - sample.transpose(2, 0, 1)).max() < 1e-3 * 255


def test_measure_reports_a_rate_per_variant_and_refuses_nonsense():
    res = rate.measure(width=300, height=240, target_kb=30, rounds=1, images=1)
    assert [r.variant for r in res.rates] == list(rate.VARIANTS)
    assert all(r.wall_per_s > 0 and r.cpu_per_s > 0 for r in res.rates)
    assert "dle-worker" in rate.format_result(res)
    with pytest.raises(ValueError, match="rounds and images"):
        rate.measure(rounds=0)
    with pytest.raises(ValueError, match="width"):
        rate.measure(width=100)
