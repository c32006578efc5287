"""The records between launcher and workers (protocol.py), and the failure summary rendered from them."""

import types

from dpscale.launch.launcher import _describe_failure
from dpscale.launch.protocol import LaunchSpec, WorkerFailure, read_record, write_atomically


def test_a_spec_reads_back_as_written(tmp_path):
    spec = LaunchSpec.in_dir(tmp_path, config={"workload": "digits"}, threads=2)
    spec.write(tmp_path / "spec.json")
    assert LaunchSpec.read(tmp_path / "spec.json") == spec
    assert spec.result == str(tmp_path / "result.json") and spec.failures == str(tmp_path)


def test_a_result_is_written_whole_and_a_missing_or_bad_one_reads_as_none(tmp_path):
    write_atomically(tmp_path / "result.json", {"steps": 3})
    assert read_record(tmp_path / "result.json") == {"steps": 3}
    assert not list(tmp_path.glob("*.tmp"))
    assert read_record(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("[1, 2")
    assert read_record(tmp_path / "bad.json") is None


def test_a_failure_record_counts_only_for_the_process_that_wrote_it(tmp_path):
    WorkerFailure(rank=0, pid=111, silent_ranks=[1]).write(tmp_path)
    assert WorkerFailure.read(tmp_path, 0, 111) == WorkerFailure(rank=0, pid=111, silent_ranks=[1])
    assert WorkerFailure.read(tmp_path, 0, 222) is None  # an earlier attempt's worker wrote it
    assert WorkerFailure.read(tmp_path, 1, 111) is None


def _failed(rank: int, pid: int, exitcode: int = 1, local_rank: int = 0, others: tuple[int, ...] = ()):
    message = {"message": "CollectiveError: rank 0: ...", "extraInfo": {"py_callstack": "Traceback"}}
    failure = types.SimpleNamespace(
        error_file_data={"message": message},
        pid=pid,
        exitcode=exitcode,
        signal_name=lambda: "SIGABRT" if exitcode == -6 else "",
        local_rank=local_rank,
    )
    failures = {rank: failure, **dict.fromkeys(others, failure)}
    return types.SimpleNamespace(get_first_failure=lambda: (rank, failure), failures=failures)


def test_the_summary_names_the_hung_ranks_from_the_record(tmp_path):
    WorkerFailure(rank=0, pid=7, silent_ranks=[1, 3]).write(tmp_path)
    text = _describe_failure(_failed(0, 7), 4, 0, str(tmp_path))
    assert text.splitlines()[0] == (
        "training with 4 workers failed after 1 attempt (--max-restarts 0); "
        "rank 1, rank 3 hung: rank 0 timed out waiting for it in a collective:"
    )
    assert text.endswith("Traceback")
    # without a record (or another attempt's), the failing rank is named with its exit code
    other = _describe_failure(_failed(0, 8), 4, 0, str(tmp_path))
    assert "last failure: rank 0 exited with code 1" in other


def test_the_summary_names_the_rank_still_running_when_nccls_watchdog_aborted_the_others(tmp_path):
    # NCCL's watchdog aborts a rank whose collective timed out (SIGABRT) before dpscale's diagnosis
    # can write a record: the ranks the agent still had to stop are the ones that hung
    text = _describe_failure(_failed(4, 7, exitcode=-6, local_rank=0, others=(6, 7)), 4, 0, str(tmp_path))
    assert text.splitlines()[0].endswith(
        "rank 5 hung: rank 4 was aborted (SIGABRT, as NCCL's watchdog does when a collective times out) "
        "while rank 5 still ran:"
    )
    # every rank of the host aborted: nothing to name beyond the signal
    alone = _describe_failure(_failed(0, 7, exitcode=-6, others=(1,)), 2, 0, str(tmp_path))
    assert "last failure: rank 0 was killed by signal 6 (SIGABRT)" in alone
