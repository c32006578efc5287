"""How many ImageNet training samples one CPU core prepares: the host input pipeline's per-core rate.

    python benchmarks/imagenet_input_rate.py [--rounds 30] [--images 20] [--json out.json]

`dpscale predict`'s input-pipeline term needs the rate at which a node's host decodes and augments
its samples (docs/performance-model.md, "At-scale terms"). No source at hand publishes that rate for
the hosts of the published ResNet-50 cases (DGX-1: Xeon E5-2698 v4; DGX A100: EPYC 7742), so this
measures it here, for one process with one thread, on what one PyTorch loader worker does per image:

- `dle-worker`: what NVIDIA's ResNet-50 v1.5 README runs per image with `--data-backend pytorch`
  (DeepLearningExamples, PyTorch/Classification/ConvNets/image_classification/dataloaders.py):
  decode the JPEG to RGB with PIL, RandomResizedCrop to 224 (bilinear), a random horizontal flip,
  and the uint8 array that its collate copies into the batch (normalisation runs on the GPU);
- `torchvision`: the standard torchvision ImageNet training transform, the same plus ToTensor
  (float, CHW, /255) and Normalize, on the CPU;
- `decode`: the decode alone (PIL, to an RGB uint8 array), what ternaus/imread_benchmark times per
  image on real ImageNet validation JPEGs on other CPUs (Iglovikov & Kosarevsky, arXiv 2605.08731):
  the figure that compares this picture with real ones.

The image is generated (no download): a deterministic picture of smooth shapes and texture,
`--width` x `--height` (500 x 375, the most common ImageNet shape), saved as a JPEG whose quality is
chosen so that the file is about `--target-kb` (113 KB: ILSVRC2012's mean training file, 1,448,283,629,516
bytes over 12,811,670 files of ten copies, Dell EMC, "Ready Solutions for AI: Deep Learning with
NVIDIA", v1.0, section on the Isilon F800). The crop box follows torchvision's RandomResizedCrop
(area 8-100%, aspect 3/4-4/3, log-uniform, ten tries, then a centre crop), written from its
documentation. Variants alternate in rounds of `--images` images; per variant the figures of record
are the median and p10-p90 over rounds of images per wall second and per CPU second of the process
(the second is what a core would give the pipeline if the process had it alone: a loaded host
inflates wall time, not CPU time).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dpscale.lab.bench.rounds import quantile

CROP = 224
MEAN = (0.485, 0.456, 0.406)  # torchvision's ImageNet normalisation
STD = (0.229, 0.224, 0.225)
VARIANTS = ("dle-worker", "torchvision", "decode")


def synthetic_photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """An RGB uint8 picture with the structure JPEG meets in photographs: smooth gradients, edges
    of overlapping shapes and fine texture (pure noise would make the coder's work unlike a photo's)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * math.pi)
        img[..., c] = 110 + 60 * np.sin(2 * math.pi * (fx * x / width + fy * y / height) + phase)
    for _ in range(12):  # ellipses of flat-ish colour: edges at many angles
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(20, width / 3), rng.uniform(20, height / 3)
        inside = ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1
        img[inside] = 0.4 * img[inside] + 0.6 * rng.uniform(0, 255, 3)
    img += rng.normal(0, 9, img.shape)  # texture: what costs the entropy coder most
    return np.clip(img, 0, 255).astype(np.uint8)


def encode_near(picture: np.ndarray, target_bytes: int) -> tuple[bytes, int]:
    """The JPEG (and its quality) whose size is closest to `target_bytes`, quality 50-98."""
    from PIL import Image

    image = Image.fromarray(picture)
    best: tuple[bytes, int] | None = None
    for quality in range(50, 99):
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=quality)
        data = buf.getvalue()
        if best is None or abs(len(data) - target_bytes) < abs(len(best[0]) - target_bytes):
            best = (data, quality)
    assert best is not None
    return best


def crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a RandomResizedCrop: 8-100% of the area, aspect 3/4-4/3 (log-uniform)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    side = min(width, height)  # fallback: the centre square
    return (width - side) // 2, (height - side) // 2, side, side


def dle_worker(data: bytes, rng: random.Random) -> np.ndarray:
    """One sample as DeepLearningExamples' PyTorch loader worker prepares it: HWC uint8."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")  # convert forces the decode
    left, top, w, h = crop_box(*image.size, rng)
    image = image.resize((CROP, CROP), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(image, dtype=np.uint8)


def torchvision_standard(data: bytes, rng: random.Random) -> torch.Tensor:
    """The same, then ToTensor and Normalize on the CPU: CHW float32."""
    pixels = torch.from_numpy(dle_worker(data, rng).copy()).permute(2, 0, 1).float().div_(255)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return pixels.sub_(mean).div_(std)


def decode_only(data: bytes, rng: random.Random) -> np.ndarray:
    """The JPEG decoded to an RGB uint8 array, nothing else."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


PIPELINES = {"dle-worker": dle_worker, "torchvision": torchvision_standard, "decode": decode_only}


@dataclass(frozen=True)
class VariantRate:
    variant: str
    wall_per_s: float  # median over rounds of images per wall-clock second
    wall_p10: float
    wall_p90: float
    cpu_per_s: float  # median over rounds of images per CPU second of this process
    cpu_p10: float
    cpu_p90: float


@dataclass(frozen=True)
class InputRateResult:
    width: int
    height: int
    jpeg_bytes: int
    quality: int
    rounds: int
    images_per_round: int
    rates: list[VariantRate]
    pillow: str
    libjpeg_turbo: bool
    torch_threads: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure(
    *, width: int = 500, height: int = 375, target_kb: float = 113.0, rounds: int = 30, images: int = 20
) -> InputRateResult:
    if rounds < 1 or images < 1:
        raise ValueError(f"rounds and images must be >= 1, got {rounds} and {images}")
    if width < CROP or height < 1:
        raise ValueError(f"width must be >= {CROP} and height >= 1, got {width} x {height}")
    import PIL
    import PIL.features

    torch.set_num_threads(1)  # one loader worker: one process, one thread
    data, quality = encode_near(synthetic_photo(width, height), round(target_kb * 1000))
    rng = random.Random(0)
    for fn in PIPELINES.values():  # warm-up: imports, allocator, caches
        for _ in range(3):
            fn(data, rng)
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # alternate the order between rounds
        for variant in order:
            fn = PIPELINES[variant]
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(images):
                fn(data, rng)
            wall[variant].append(images / (time.perf_counter() - t0))
            cpu[variant].append(images / max(time.process_time() - c0, 1e-9))
    rates = [
        VariantRate(
            v,
            statistics.median(wall[v]),
            quantile(wall[v], 0.1),
            quantile(wall[v], 0.9),
            statistics.median(cpu[v]),
            quantile(cpu[v], 0.1),
            quantile(cpu[v], 0.9),
        )
        for v in VARIANTS
    ]
    return InputRateResult(
        width=width,
        height=height,
        jpeg_bytes=len(data),
        quality=quality,
        rounds=rounds,
        images_per_round=images,
        rates=rates,
        pillow=PIL.__version__,
        libjpeg_turbo=bool(PIL.features.check_feature("libjpeg_turbo")),
        torch_threads=torch.get_num_threads(),
    )


def format_result(res: InputRateResult) -> str:
    lines = [
        f"JPEG {res.width} x {res.height}, {res.jpeg_bytes / 1000:.1f} KB (quality {res.quality}); "
        f"Pillow {res.pillow}, libjpeg-turbo {res.libjpeg_turbo}; {res.rounds} alternating rounds of "
        f"{res.images_per_round} images, one process, one thread",
        "| variant | images/s (wall), median (p10-p90) | images/s per CPU second, median (p10-p90) |",
        "|---|---:|---:|",
    ]
    for r in res.rates:
        lines.append(
            f"| {r.variant} | {r.wall_per_s:.0f} ({r.wall_p10:.0f}-{r.wall_p90:.0f}) | "
            f"{r.cpu_per_s:.0f} ({r.cpu_p10:.0f}-{r.cpu_p90:.0f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--images", type=int, default=20, help="images per round and variant")
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--target-kb", type=float, default=113.0, help="JPEG size to aim for")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    try:
        res = measure(
            width=args.width,
            height=args.height,
            target_kb=args.target_kb,
            rounds=args.rounds,
            images=args.images,
        )
    except ValueError as e:
        parser.exit(2, f"imagenet_input_rate: {e}\n")
    print(format_result(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.to_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
