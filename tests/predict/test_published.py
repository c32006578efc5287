"""The published cases reproduce, and the two predictions bracket each other sensibly."""

from dpscale.predict.published import cases, reproduce


def test_each_case_reproduces_with_sources_and_a_bracket():
    all_cases = cases()
    assert len(all_cases) >= 3
    for case in all_cases:
        r = reproduce(case)
        assert case.source and case.notes
        assert 0 < r.predicted_no_overlap <= r.predicted_overlap <= 1.0
        row = r.row()
        assert row["published"].endswith("%") and row["bottleneck"]
