"""Published results at 8 to 1024 GPUs: cited cases, a split by rule, the fit the docs state, and the
held-out error docs/performance-model.md reports (pure computation, no processes)."""

from dataclasses import replace

import pytest
from published import (
    FITTED,
    fit,
    fit_input_per_core,
    format_study,
    held_out_study,
    input_per_core_lower_bound,
)
from published_case import TARGET_POINTS, WORST_POINTS, reproduce, with_accumulation
from published_cases import (
    BERT_LOSS_TABLE_ACCUMULATION,
    FFCV_PYTORCH_LOADER_FROM_RAM,
    cases,
    held_out_cases,
    loader_rate_per_core,
    training_cases,
)

from dpscale.lab.predict.cluster import ETH_EFFICIENCY, GPU_COMPUTE_CV, GPU_NODE_CV

# the held-out errors in points, as docs/performance-model.md reports them (predicted - published)
DOCUMENTED_HELD_OUT = {
    "Horovod, Inception V3 (23.8 M), 512 Pascal GPUs": -1.5,
    "Horovod, ResNet-101 (44.5 M), 512 Pascal GPUs": -2.7,
    "Horovod, VGG-16 (138.4 M), 512 Pascal GPUs": +7.8,
    "NVIDIA BERT-large pre-training, seq 128, 64 x DGX-2H (1024 V100)": +8.1,
    "NVIDIA BERT-large pre-training, seq 512, 64 x DGX-2H (1024 V100)": +1.0,
    "NVIDIA BERT-large pre-training, seq 128, 16 x DGX-1 (128 V100)": +0.3,
    "NVIDIA BERT-large pre-training, seq 512, 16 x DGX-1 (128 V100)": +0.3,
    "NVIDIA BERT-large pre-training, seq 128, 8 V100 in one DGX-1 16G": -2.1,
    "NVIDIA BERT-large pre-training, seq 512, 8 V100 in one DGX-1 16G": -0.8,
    "NVIDIA BERT-large pre-training, seq 128, 8 V100 in one DGX-1 32G": -0.9,
    "NVIDIA BERT-large pre-training, seq 512, 8 V100 in one DGX-1 32G": -1.8,
    "NVIDIA BERT-large pre-training, seq 128, 16 V100 in one DGX-2": -2.0,
    "NVIDIA BERT-large pre-training, seq 512, 16 V100 in one DGX-2": -2.4,
    "NVIDIA BERT-large pre-training, seq 128, 8 A100 in one DGX A100, TF32": +2.3,
    "NVIDIA BERT-large pre-training, seq 128, 8 A100 in one DGX A100": -0.2,
    "NVIDIA BERT-large pre-training, seq 512, 8 A100 in one DGX A100, TF32": -2.2,
    "NVIDIA BERT-large pre-training, seq 512, 8 A100 in one DGX A100": +0.2,
    "NVIDIA ResNet-50 v1.5, mixed precision, 8 x A100 (DGX A100)": +13.0,
    "NVIDIA ResNet-50 v1.5, mixed precision, 8 x V100 (DGX-1 16G)": +10.4,
    "NVIDIA ResNet-50 v1.5, mixed precision, 8 x V100 (DGX-1 32G)": +10.1,
    "Goyal et al. 2017, ResNet-50, 256 P100": +3.2,
}


def test_at_least_8_cited_cases_spanning_8_to_1024_gpus_and_both_kinds_of_model():
    all_cases = cases()
    assert len(all_cases) >= 8
    for c in all_cases:
        assert c.source and c.how and c.interconnect and c.step_source, c.name
        assert 0 < c.published_efficiency <= 1
    assert min(c.gpus for c in all_cases) <= 8 and max(c.gpus for c in all_cases) == 1024
    # compute-bound (ResNet, Inception: < 50 M parameters) and bandwidth-bound (VGG-16, BERT-large)
    assert {c.params < 50e6 for c in all_cases} == {True, False}


def test_every_regime_has_cases_inside_a_node_and_across_nodes_up_to_1024():
    all_cases = cases()
    one_node = [c for c in all_cases if c.gpus <= c.workers_per_node]
    many = [c for c in all_cases if c.gpus > c.workers_per_node]
    # inside one node: compute-bound (ResNet-50) and bandwidth-bound (BERT-large's 680 MB on NVLink)
    assert {c.params < 50e6 for c in one_node} == {True, False}
    assert {c.params < 50e6 for c in many} == {True, False}
    assert {128, 256, 512, 1024} <= {c.gpus for c in many}


def test_the_split_is_the_rule_and_halves_the_cases():
    held, train = held_out_cases(), training_cases()
    assert not set(map(id, held)) & set(map(id, train))
    # about half: the rule holds out one size per family, and some families have three sizes
    assert len(held) + len(train) == len(cases()) and 0.4 <= len(held) / len(cases()) <= 0.6
    # the largest GPU count of every family with more than one is held out
    assert {c.name for c in held} == set(DOCUMENTED_HELD_OUT)


def test_the_fitted_parameters_are_the_presets():
    assert FITTED.eth_efficiency == ETH_EFFICIENCY and FITTED.compute_cv == GPU_COMPUTE_CV
    assert FITTED.node_cv == GPU_NODE_CV


def test_held_out_errors_are_the_documented_ones_and_the_target_is_reported_honestly():
    study = held_out_study(FITTED)
    held = {r.case.name: r.error_points for r in study.rows if r.held_out}
    assert held == pytest.approx(DOCUMENTED_HELD_OUT, abs=0.05)
    worst = max(abs(e) for e in held.values())
    # the target (every case within 3 points, worst <= 5) is NOT met on the held-out half;
    # this test fails if the model changes, so that the docs' table is redone with it
    assert worst == pytest.approx(13.0, abs=0.05) and worst > WORST_POINTS
    text = format_study(study)
    assert "held out: 15/21 within 3 points, mean |error| 3.5, worst 13.0 points" in text


@pytest.mark.slow
def test_refitting_on_the_training_half_gives_the_recorded_parameters():
    assert fit(training_cases()) == FITTED


def test_the_bert_throughput_rows_ran_one_all_reduce_per_step_not_the_loss_tables_accumulation():
    # docs/performance-model.md: with the loss table's accumulation steps the DGX-1 rows would lose
    # almost nothing to communication (96-98%), yet they are published at 87-89%, which one
    # all-reduce per step reproduces within a point
    dgx1 = [c for c in cases() if c.family.startswith("bert-dgx-1-seq")]
    assert len(dgx1) == 4
    for c in dgx1:
        seq = 128 if "seq 128" in c.name else 512
        steps = BERT_LOSS_TABLE_ACCUMULATION[("DGX-1", seq)]
        accumulated = with_accumulation(c, FITTED, steps[1], steps[c.gpus // c.workers_per_node])
        assert accumulated > 0.95 > 0.90 > c.published_efficiency, c.name
        assert with_accumulation(c, FITTED, 1, 1) == pytest.approx(reproduce(c, FITTED).predicted)
        assert abs(reproduce(c, FITTED).error_points) < 1.0
    with pytest.raises(ValueError, match="reduce after backward"):
        with_accumulation(cases()[0], FITTED, 1, 2)


def test_the_training_half_bounds_the_host_input_rate_from_below_only():
    # the ResNet-50 tables decode JPEGs on the host: its cores from the DGX datasheets
    fed = [c for c in cases() if c.host_cores is not None]
    assert {(c.name.split("(")[-1].rstrip(")"), c.host_cores) for c in fed} == {
        ("DGX A100", 128), ("DGX-1 16G", 40), ("DGX-1 32G", 40)
    }  # fmt: skip
    train = [c for c in training_cases() if c.host_cores is not None]
    assert len(train) == 3  # FP32 / TF32: 938, 367, 356 img/s per GPU against 2470, 1200, 1156
    bound = input_per_core_lower_bound(training_cases(), FITTED)
    assert bound == pytest.approx(71.3, abs=0.1)
    # at or above the bound no training prediction moves; below it one waits for data and misses more
    at = replace(FITTED, input_per_core=bound * 1.001)
    assert [reproduce(c, at).predicted for c in train] == [reproduce(c, FITTED).predicted for c in train]
    below = replace(FITTED, input_per_core=bound * 0.9)
    assert max(abs(reproduce(c, below).error_points) for c in train) > 5
    # so the fit leaves the term off (unlimited), and the held-out half cannot be used to pick a rate
    assert fit_input_per_core(training_cases(), FITTED) is None and FITTED.input_per_core is None


def test_no_single_rate_per_host_core_fits_the_three_mixed_precision_rows():
    # docs/performance-model.md: a diagnostic of the term's form, not a fit: DGX A100 needs 125-134
    # samples/s per core, the DGX-1s 201-215; no rate puts all three within 3 points
    held = [c for c in held_out_cases() if c.host_cores is not None]
    assert len(held) == 3
    for rate in range(60, 400, 2):
        params = replace(FITTED, input_per_core=float(rate))
        assert max(abs(reproduce(c, params).error_points) for c in held) > TARGET_POINTS, rate


def test_a_published_whole_loader_rate_does_not_predict_the_three_mixed_precision_rows():
    # docs/performance-model.md (#16, fifth round): FFCV's figure of a PyTorch DataLoader on a
    # p3dn.24xlarge, 2211 img/s on 12 cores, carried to the DGX hosts per core (a check, not a fit)
    held = {c.name: c for c in held_out_cases() if c.host_cores is not None}
    rate = loader_rate_per_core()
    assert rate == pytest.approx(184.25)

    def errors(per_core):
        return [
            round(reproduce(c, replace(FITTED, input_per_core=per_core)).error_points, 1)
            for c in held.values()
        ]

    # DGX A100, DGX-1 16G, DGX-1 32G, in case order
    assert [c.host_cores for c in held.values()] == [128, 40, 40]
    # the figure's cores as physical cores: the DGX-1 rows flip to 7-10 points low, DGX A100 stays
    assert errors(rate) == [13.0, -9.9, -7.3]
    # its cores as hyperthreads (two per core on these hosts too): the term never binds
    assert errors(2 * rate) == [DOCUMENTED_HELD_OUT[name] for name in held]
    # and the rate the figure's one loader levels off at (3955 img/s) is above what each GPU's loader
    # (one per GPU process in the README's scripts) delivered at 8: 2075 (A100), 1040 and 1006 (V100)
    per_gpu = [c.published_efficiency * c.per_gpu_batch * 1000 / c.single_gpu_step_ms for c in held.values()]
    assert [round(r) for r in per_gpu] == [2075, 1040, 1006]
    assert max(per_gpu) < FFCV_PYTORCH_LOADER_FROM_RAM[-1][1]


def test_no_sourced_rate_in_either_form_of_the_input_term_brings_the_three_rows_within_5_points():
    # docs/performance-model.md (#33, session 13): why the 5-point target is blocked on public data.
    held = [c for c in held_out_cases() if c.host_cores is not None]
    # per core: whatever one rate a source gave, one host or the other stays more than 5 points off
    for rate in [*range(20, 400, 5), *range(400, 2001, 100)]:
        params = replace(FITTED, input_per_core=float(rate))
        assert max(abs(reproduce(c, params).error_points) for c in held) > WORST_POINTS, rate
    # per loader process (--data-workers K, R = r1 * K * g; configs.yml: K = 16 on the DGX A100's
    # 128 cores, 8 on the DGX-1s' 40): at the sourced single-process rates (400 img/s and up) the term
    # does not bind, so the three stay where they are (+10 to +13)
    workers_per_gpu = {128: 16, 40: 8}
    for r1 in (400.0, 503.0, 590.0):
        for c in held:
            assert c.host_cores is not None
            per_core = r1 * workers_per_gpu[c.host_cores] * c.workers_per_node / c.host_cores
            error = reproduce(c, replace(FITTED, input_per_core=per_core)).error_points
            assert round(error, 1) == DOCUMENTED_HELD_OUT[c.name], (r1, c.name)


def test_horovods_benchmarks_ran_64_images_per_gpu_as_the_cases_assume():
    # docs/performance-model.md: a maintainer wrote "32 per worker for all our benchmarks" (horovod
    # issue #425); with 32 the 128-GPU training cases, reproduced within 1 point at 64, miss by 3.5-33
    train = [c for c in training_cases() if c.name.startswith("Horovod")]
    assert len(train) == 3
    for c in train:
        at_32 = replace(c, per_gpu_batch=32, single_gpu_step_ms=c.single_gpu_step_ms / 2)
        assert abs(reproduce(c, FITTED).error_points) < 1.1
        assert reproduce(at_32, FITTED).error_points < -TARGET_POINTS


def test_the_cases_collected_after_the_results_are_kept_apart_and_reported_with_the_training_fit():
    from published_posthoc import format_posthoc, posthoc_cases, posthoc_study

    extra = posthoc_cases()
    # kept out of both halves: nothing is fitted on them
    assert not {c.name for c in extra} & {c.name for c in cases()}
    for c in extra:
        assert c.source and c.how and c.step_source and c.host_cores in (40, 128), c.name
        assert 0 < c.published_efficiency <= 1, c.name  # the rule drops the impossible rows
    assert len(extra) == 18 and max(c.gpus for c in extra) == 64
    study = posthoc_study()
    assert study.params == FITTED
    # docs/performance-model.md's figures; every mixed-precision B0 row misses as ResNet-50's do
    assert "post hoc: 7/18 within 3 points, mean |error| 7.4, worst 22.4 points" in format_posthoc(study)
    b0_mixed = [r for r in study.rows if "B0, mixed" in r.case.name]
    assert len(b0_mixed) == 4 and min(r.error_points for r in b0_mixed) > 13


def test_the_readmes_earlier_tables_put_the_resnet50_shortfall_with_the_input_pipeline():
    """Issue #33 (session 12): the same systems' tables of pytorch-20.06 (DALI on the host's CPUs)
    and pytorch-20.12 (the PyTorch loader), apart from both halves and from the band."""
    from published_posthoc import format_posthoc
    from published_rn50_history import history_cases, history_study

    extra = history_cases()
    assert not {c.name for c in extra} & {c.name for c in cases()}
    assert len(extra) == 12 and {c.gpus for c in extra} == {8}
    for c in extra:  # the strong-scaling column as printed is the ratio of the two throughputs
        assert c.source and c.how and c.host_cores in (40, 128), c.name
    study = history_study()
    assert study.params == FITTED
    by_name = {r.case.name: r.error_points for r in study.rows}
    # mixed precision with DALI (20.06) scales as the model says; with the PyTorch loader (20.12) it
    # misses as the 21.03 rows do, while FP32/TF32 with the same loader do not
    for name, err in by_name.items():
        if "20.06" in name or "mixed" not in name:
            assert abs(err) < TARGET_POINTS, (name, err)
        else:
            assert err > 3 * TARGET_POINTS, (name, err)
    assert "post hoc:" in format_posthoc(study)
