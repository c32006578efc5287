"""The published data-parallel results at 8 to 1024 GPUs, each cited, and the split rule.

The split is fixed by a rule, not by the results: in each source's family of cases the largest GPU
count is held out (where a family has one GPU count, every second case in source order), everything
else trains (`held_out_cases`, `training_cases`). Cases collected after the held-out results were
known are in published_posthoc.py, outside both halves.
"""

from __future__ import annotations

from published_case import PublishedCase

# NVIDIA's BERT README, 'Pre-training loss results': accumulation steps (phase 1 = seq 128, phase 2 =
# seq 512) per number of nodes, for the training runs. Whether the throughput rows ran with them is
# what `with_accumulation` checks (docs/performance-model.md: they did not).
BERT_LOSS_TABLE_ACCUMULATION = {
    ("DGX-2H", 128): {1: 64, 4: 16, 16: 4, 64: 1},
    ("DGX-2H", 512): {1: 256, 4: 64, 16: 16, 64: 4},
    ("DGX-1", 128): {1: 512, 4: 128, 16: 32},
    ("DGX-1", 512): {1: 1024, 4: 256, 16: 64},
}

# A whole PyTorch DataLoader's rate from a published figure (#16, fifth round): ImageNet at 512 px from
# RAM, RandomResizedCrop 224 + horizontal flip, on an AWS p3dn.24xlarge (2 x Xeon Platinum 8175M,
# 96 vCPUs), as (cores, images/s). Read off FFCV's documentation figure (libffcv/ffcv,
# docs/_static/benchmarking_results_t.svg, 2022-01-10, the "Pytorch 512px" line, "From RAM") by its
# axis ticks; the same reading gives the page's FFCV table (31278 and 172801 img/s) within 1 img/s.
# Not the published hosts' CPUs and no sourced ratio to them, so no preset carries it: the docs report
# what it would predict (a check of the input-pipeline term, not an input of the fit).
FFCV_PYTORCH_LOADER_FROM_RAM = ((12, 2211.0), (24, 3804.0), (48, 3950.0), (96, 3955.0))


def loader_rate_per_core() -> float:
    """Images/s per core at the figure's first point (12 cores), before its loader levels off."""
    cores, rate = FFCV_PYTORCH_LOADER_FROM_RAM[0]
    return rate / cores


# VGG-16 (Simonyan & Zisserman 2015, configuration D), 224 x 224 input: parameters and multiply-adds
# per layer, input to output (13 conv layers, then fc6-fc8). 89% of the parameters are in the fc
# layers, which backward reaches first: most of the gradient is ready early.
_VGG16 = (
    (1_792, 86.7e6), (36_928, 1850e6), (73_856, 925e6), (147_584, 1850e6), (295_168, 925e6),
    (590_080, 1850e6), (590_080, 1850e6), (1_180_160, 925e6), (2_359_808, 1850e6), (2_359_808, 1850e6),
    (2_359_808, 462e6), (2_359_808, 462e6), (2_359_808, 462e6),
    (102_764_544, 102.8e6), (16_781_312, 16.8e6), (4_097_000, 4.1e6),
)  # fmt: skip
_VGG16_LAYERS = tuple((p, macs / sum(m for _, m in _VGG16)) for p, macs in _VGG16)

_HOROVOD = (
    "Horovod documentation, Benchmarks (docs/benchmarks.rst) and README: '128 servers with 4 Pascal GPUs "
    "each connected by a RoCE-capable 25 Gbit/s network ... 90% scaling efficiency for both Inception V3 "
    "and ResNet-101, and 68% scaling efficiency for VGG-16'; the earlier README (2017): '32 servers with 4 "
    "Pascal GPUs ... 90% ... Inception V3 and ResNet-101, and 79% ... VGG-16'"
)
_HOROVOD_HOW = "scaling efficiency = images/s at N / (N x images/s of one GPU), tf_cnn_benchmarks, batch 64"
_TF_P100 = "tensorflow.org Benchmarks (May 2017), DGX-1 P100, synthetic data, batch 64: 1 GPU"
_DLE_BERT = (
    "NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md (2020), 'Pre-training on "
    "multiple NVIDIA DGX-{node}' table, BERT-large, mixed precision, sequence length {seq}"
)
_DLE_BERT_NODE = (
    "NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md (2020), 'Pre-training "
    "NVIDIA {system}' table ({container} container), BERT-large, {precision}, sequence length {seq}"
)
_DLE_BERT_ACC_NOTES = (
    "The table states the accumulated batch per GPU and the accumulation steps (the global batch is "
    "fixed, so fewer steps per all-reduce on more GPUs); the micro-batch is their ratio. One all-reduce "
    "of 340 M gradients (fp16 in mixed precision, fp32 in TF32) after the last micro-batch's backward."
)
_DLE_BERT_HOW = "weak scaling column: sequences/s at N nodes / sequences/s of 1 node; here / N"
_DLE_BERT_NOTES = (
    "One fp16 all-reduce of 340 M gradients (Devlin et al. 2019) per step of the stated batch, after "
    "backward (NVIDIA's BERT reduces after accumulation, so nothing overlaps); no accumulation assumed "
    "in the benchmark rows. Single-node throughput from the same table; NCCL 2.4 picks ring or tree."
)


def _horovod(model: str, params: float, images_s: float, step_src: str, gpus: int, eff: float, **kw):
    servers = gpus // 4
    return PublishedCase(
        name=f"Horovod, {model}, {gpus} Pascal GPUs",
        family="horovod",
        source=_HOROVOD,
        model=model,
        params=params,
        bytes_per_param=4,
        per_gpu_batch=64,
        single_gpu_step_ms=1000 * 64 / images_s,
        step_source=step_src,
        backward_fraction=2 / 3,
        interconnect=f"{servers} servers x 4 Pascal GPUs (PCIe), RoCE 25 Gbit/s",
        intra="pcie3-x16",
        inter="roce-25g",
        workers_per_node=4,
        algorithm="ring",  # NCCL 2 ring across all GPUs (trees came with NCCL 2.4, 2019)
        bucket_mb=64.0,  # Tensor Fusion's 64 MB buffer
        overlap=True,
        baseline_gpus=1,
        gpus=gpus,
        published_efficiency=eff,
        how=_HOROVOD_HOW,
        notes=(
            "Pascal model not named: P100 speed from the TensorFlow benchmark page; 'PCIe' within a "
            "server assumed. " + kw.pop("notes", "")
        ),
        **kw,
    )


def _bert(
    system: str,
    seq: int,
    batch: int,
    base_seq_s: float,
    gpus: int,
    weak: float,
    *,
    precision: str = "mixed precision",
    accumulation: tuple[int, int] = (1, 1),
) -> PublishedCase:
    """DGX-1 / DGX-2H rows scale whole nodes from one node; "... 16G", "... 32G", "DGX-2" and "DGX A100"
    rows scale one node from one GPU, where the all-reduce stays on NVLink (the intra-node regime).
    `batch` is the micro-batch per GPU; `accumulation` the micro-batches per all-reduce (1 GPU, N)."""
    g = 16 if system.startswith("DGX-2") else 8
    a100 = system == "DGX A100"
    gpu, nvlink = ("A100", "NVLink 3") if a100 else ("V100", "NVLink 2")
    one_node = system in ("DGX-1", "DGX-2H")  # the multi-node tables: baseline one node
    base = g if one_node else 1
    nics = 8 if g == 16 else 4
    fabric = "NVSwitch" if g == 16 or a100 else "hybrid cube mesh"
    if one_node:
        name = f"{gpus // g} x {system} ({gpus} V100)"
        source = _DLE_BERT.format(node=system.removeprefix("DGX-"), seq=seq)
        how = _DLE_BERT_HOW + f" ({weak} / {gpus // g})"
        step_source = "the same table: one node's sequences/s / its GPUs (one node's own comm left in)"
        interconnect = f"{system}: {g} V100, NVLink 2 ({fabric}), {nics} x InfiniBand EDR 100 Gb/s"
    else:
        name = f"{gpus} {gpu} in one {system}" + ("" if precision == "mixed precision" else f", {precision}")
        container = "pytorch:20.06-py3" if a100 else "pytorch:19.07-py3"
        source = _DLE_BERT_NODE.format(system=system, seq=seq, container=container, precision=precision)
        how = f"weak scaling column: sequences/s on N GPUs / sequences/s on 1 GPU; here / N ({weak} / {gpus})"
        step_source = f"the same table: {base_seq_s} sequences/s on 1 GPU ({precision})"
        interconnect = f"{system}: {g} {gpu}, {nvlink} ({fabric})"
    return PublishedCase(
        name=f"NVIDIA BERT-large pre-training, seq {seq}, {name}",
        family=f"bert-{system.lower().replace(' ', '-')}-seq{seq}-{precision.split()[0].lower()}",
        source=source,
        model=f"BERT-large (340 M parameters), seq {seq}",
        params=340e6,
        bytes_per_param=2 if precision == "mixed precision" else 4,  # TF32: fp32 gradients
        per_gpu_batch=batch,
        single_gpu_step_ms=1000 * batch / (base_seq_s / base),
        step_source=step_source,
        backward_fraction=2 / 3,
        interconnect=interconnect,
        intra="nvlink3" if a100 else "nvlink2",
        inter="8xib-hdr200" if a100 else f"{nics}xib-edr100",  # unused by the one-node tables
        workers_per_node=g,
        algorithm="auto",
        bucket_mb=1e6,  # one flat all-reduce
        overlap=False,
        baseline_gpus=base,
        gpus=gpus,
        published_efficiency=weak / (gpus // base),
        how=how,
        notes=_DLE_BERT_NOTES if accumulation == (1, 1) else _DLE_BERT_ACC_NOTES,
        accumulation=accumulation,
    )


def cases() -> list[PublishedCase]:
    rn101_notes = (
        "ResNet-101 is not on the TensorFlow page: 129 images/s interpolated between ResNet-50 (219) and "
        "ResNet-152 (91.8) by forward FLOPs (3.8, 7.6, 11.3 G; He et al. 2016)."
    )
    out = []
    for gpus, effs in ((128, (0.90, 0.90, 0.79)), (512, (0.90, 0.90, 0.68))):
        out += [
            _horovod("Inception V3 (23.8 M)", 23.8e6, 142, _TF_P100 + " 142 images/s", gpus, effs[0]),
            _horovod(
                "ResNet-101 (44.5 M)", 44.5e6, 129, "derived, see notes", gpus, effs[1], notes=rn101_notes
            ),
            _horovod(
                "VGG-16 (138.4 M)",
                138.4e6,
                154,
                _TF_P100 + " 154 images/s",
                gpus,
                effs[2],
                layers=_VGG16_LAYERS,
            ),
        ]
    for seq, batch, one_node, rows in (
        (128, 64, 3379.2, ((4, 3.76), (16, 15.37), (64, 55.66))),
        (512, 8, 625.66, ((4, 3.81), (16, 15.87), (64, 59.9))),
    ):
        out += [_bert("DGX-2H", seq, batch, one_node, 16 * nodes, weak) for nodes, weak in rows]
    for seq, batch, one_node, rows in (
        (128, 16, 874.24, ((4, 3.53), (16, 13.89))),
        (512, 4, 195.93, ((4, 3.57), (16, 14.02))),
    ):
        out += [_bert("DGX-1", seq, batch, one_node, 8 * nodes, weak) for nodes, weak in rows]
    # one node, 1 -> 4 -> 8 (16) GPUs: the bandwidth-bound regime inside a node (NVLink 2)
    for system, seq, batch, one_gpu, rows in (
        ("DGX-1 16G", 128, 16, 125.44, ((4, 3.65), (8, 7.32))),
        ("DGX-1 16G", 512, 4, 26.64, ((4, 3.69), (8, 7.30))),
        ("DGX-1 32G", 128, 64, 171.52, ((4, 3.82), (8, 7.62))),
        ("DGX-1 32G", 512, 8, 30.08, ((4, 3.82), (8, 7.61))),
        ("DGX-2", 128, 64, 181.76, ((4, 3.87), (8, 7.72), (16, 15.26))),
        ("DGX-2", 512, 8, 32.32, ((4, 3.84), (8, 7.64), (16, 15.13))),
    ):
        out += [_bert(system, seq, batch, one_gpu, gpus, weak) for gpus, weak in rows]
    # DGX A100, pytorch:20.06: the rows state accumulation steps (1 GPU, then per row); micro-batch =
    # accumulated batch per GPU / steps (65232 / 1208 = 54, 65536 / 1024 = 64, 32768 / 4096 = 8, / 2048 = 16)
    for seq, precision, batch, one_gpu, base_steps, rows in (
        (128, "TF32", 54, 234, 1208, ((4, 302, 3.89), (8, 151, 7.59))),
        (128, "mixed precision", 64, 415, 1024, ((4, 256, 3.90), (8, 128, 7.79))),
        (512, "TF32", 8, 41, 4096, ((4, 1024, 3.88), (8, 512, 7.95))),
        (512, "mixed precision", 16, 78, 2048, ((4, 512, 3.95), (8, 256, 7.76))),
    ):
        out += [
            _bert(
                "DGX A100", seq, batch, one_gpu, gpus, weak, precision=precision, accumulation=(base_steps, k)
            )
            for gpus, k, weak in rows
        ]
    dle_rn50 = "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md"
    # the hosts' CPU cores, which decode the JPEGs: NVIDIA DGX A100 datasheet (2 x AMD EPYC 7742,
    # 128 cores) and NVIDIA DGX-1 datasheet (2 x 20-core Intel Xeon E5-2698 v4)
    host_cores = {"DGX A100": 128, "DGX-1 16G": 40, "DGX-1 32G": 40}
    # (system, table, intra link, precision, per-GPU batch (configs.yml), img/s on 1 GPU, strong scaling)
    for system, table, intra, precision, batch, one, strong in (
        ("DGX A100", "NVIDIA DGX A100 (8x A100 80GB)", "nvlink3", "TF32", 256, 938, 7.72),
        ("DGX A100", "NVIDIA DGX A100 (8x A100 80GB)", "nvlink3", "mixed precision", 256, 2470, 6.72),
        ("DGX-1 16G", "NVIDIA DGX-1 16GB (8x V100 16GB)", "nvlink2", "FP32", 112, 367, 7.76),
        ("DGX-1 16G", "NVIDIA DGX-1 16GB (8x V100 16GB)", "nvlink2", "mixed precision", 256, 1200, 6.93),
        ("DGX-1 32G", "NVIDIA DGX-1 32GB (8x V100 32GB)", "nvlink2", "FP32", 112, 356, 7.75),
        ("DGX-1 32G", "NVIDIA DGX-1 32GB (8x V100 32GB)", "nvlink2", "mixed precision", 256, 1156, 6.96),
    ):
        gpu = "A100" if system == "DGX A100" else "V100"
        out.append(
            PublishedCase(
                name=f"NVIDIA ResNet-50 v1.5, {precision}, 8 x {gpu} ({system})",
                family=f"dle-rn50-{system.lower().replace(' ', '-')}",
                source=f"{dle_rn50}, 'Training performance: {table}'",
                model="ResNet-50 v1.5 (25.6 M)",
                params=25.6e6,
                bytes_per_param=4,  # fp32 master gradients, as AMP keeps them
                per_gpu_batch=batch,
                single_gpu_step_ms=1000 * batch / one,
                step_source=f"the same table: {one} img/s on 1 GPU",
                backward_fraction=2 / 3,
                interconnect=(
                    f"{system}: 8 {gpu}, "
                    + ("NVLink 3 (NVSwitch)" if gpu == "A100" else "NVLink 2 (hybrid cube mesh)")
                ),
                intra=intra,
                inter="8xib-hdr200" if gpu == "A100" else "4xib-edr100",
                workers_per_node=8,
                algorithm="auto",
                bucket_mb=25.0,  # torch DDP's default bucket
                overlap=True,
                baseline_gpus=1,
                gpus=8,
                published_efficiency=strong / 8,
                how=f"strong scaling column ({strong}x) / 8: img/s on 8 GPUs / on 1, batch per GPU fixed",
                notes=(
                    f"Per-GPU batch {batch}: PyTorch/Classification/ConvNets/configs.yml for this platform "
                    "and precision. Real ImageNet JPEGs decoded on the host's CPUs (the README recommends "
                    "DALI's CPU backend on DGX A100 and DGX-1), shared by the node's 8 GPUs."
                ),
                host_cores=host_cores[system],
            )
        )
    out.append(
        PublishedCase(
            name="Goyal et al. 2017, ResNet-50, 256 P100",
            family="goyal",
            source=(
                "Goyal et al., Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour (arXiv:1706.02677)"
            ),
            model="ResNet-50 (25.6 M)",
            params=25.6e6,
            bytes_per_param=4,
            per_gpu_batch=32,
            single_gpu_step_ms=232.0,
            step_source="derived from the paper's ~29 h on 8 GPUs for 90 epochs (approximate)",
            backward_fraction=120 / 232,
            interconnect="32 x Big Basin (8 P100, NVLink), one 50 Gbit Ethernet NIC per server",
            intra="nvlink1",
            inter="eth-50g",
            workers_per_node=8,
            algorithm="hierarchical",  # reduce within the server, recursive halving-doubling between
            bucket_mb=25.0,
            overlap=True,
            baseline_gpus=8,
            gpus=256,
            published_efficiency=0.90,
            how="stated: '~90% scaling efficiency' from 8 to 256 GPUs (time per epoch, batch per GPU fixed)",
            notes="Backprop of 120 ms per P100 is the paper's; Gloo over TCP assumed for the Ethernet.",
        )
    )
    return out


def held_out_cases() -> list[PublishedCase]:
    """The split rule (module docstring): per family the largest GPU count, or every second case."""
    all_cases = cases()
    out = []
    for family in dict.fromkeys(c.family for c in all_cases):
        members = [c for c in all_cases if c.family == family]
        sizes = {c.gpus for c in members}
        if len(sizes) > 1:
            out += [c for c in members if c.gpus == max(sizes)]
        else:
            out += members[1::2] if len(members) > 1 else members
    return out


def training_cases() -> list[PublishedCase]:
    held = held_out_cases()
    return [c for c in cases() if c not in held]
