"""plait.elastic.multiprocessing.errors: torch's `ProcessFailure`, `ChildFailedError` and `record`,
checked field by field and message by message against torch's own on the same failures, and the
error-file behaviour a parent's `@record` has (the first child's file becomes the parent's)."""

import json
import os

import pytest
from torch.distributed.elastic.multiprocessing import errors as torch_errors

from plait.elastic.multiprocessing import errors

FIELDS = ("local_rank", "pid", "exitcode", "error_file", "error_file_data", "message", "timestamp")


def _error_file(path, message="RuntimeError: boom", ts=1_700_000_000):
    data = {"message": {"message": message, "extraInfo": {"py_callstack": f"Traceback\n  {message}",
                                                         "timestamp": str(ts)}}}
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("case", ["error_file", "flat_error_file", "no_file_exit", "no_file_signal"])
def test_process_failure_reads_as_torch(tmp_path, case):
    if case == "error_file":
        args = (0, 4242, 1, _error_file(tmp_path / "e.json"))
    elif case == "flat_error_file":
        (tmp_path / "f.json").write_text(json.dumps({"message": "flat", "timestamp": 17}))
        args = (1, 4243, 1, str(tmp_path / "f.json"))
    else:
        args = (2, 4244, 3 if case == "no_file_exit" else -9, str(tmp_path / "missing.json"))
    ours, theirs = errors.ProcessFailure(*args), torch_errors.ProcessFailure(*args)
    for field in FIELDS:
        if field == "timestamp" and case.startswith("no_file"):
            assert abs(ours.timestamp - theirs.timestamp) <= 1
        elif field == "error_file_data" and case == "no_file_signal":
            # torch mutates one module-level dict for every file-less failure, so an earlier exit
            # failure leaks its errorTraits into this one; ours starts from a fresh dict each time
            theirs_data = {k: v for k, v in theirs.error_file_data.items() if k != "errorTraits"}
            assert ours.error_file_data == theirs_data
        elif field == "message" and case == "no_file_exit":
            assert "@record" in ours.message  # ours points at plait's decorator, not torch's docs page
        else:
            assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.signal_name() == theirs.signal_name()
    assert ours.timestamp_isoformat() == theirs.timestamp_isoformat() or case.startswith("no_file")


def test_child_failed_error_message_is_torchs(tmp_path):
    def failures(mod):
        return {3: mod.ProcessFailure(1, 11, 1, _error_file(tmp_path / "a.json", "KeyError: 'x'", 20)),
                0: mod.ProcessFailure(0, 10, 1, _error_file(tmp_path / "b.json", "ValueError: first", 10)),
                5: mod.ProcessFailure(2, 12, -15, str(tmp_path / "none.json"))}

    ours = errors.ChildFailedError("trainer", failures(errors))
    theirs = torch_errors.ChildFailedError("trainer", failures(torch_errors))
    assert ours.get_first_failure()[0] == theirs.get_first_failure()[0] == 0
    mine, torchs = str(ours).splitlines(), str(theirs).splitlines()
    assert len(mine) == len(torchs)
    for a, b in zip(mine, torchs):
        if "time      :" not in a:  # the signalled child's time is "now", read twice
            assert a == b
    with pytest.raises(ValueError, match="at least one failure"):
        errors.ChildFailedError("trainer", {})


def test_record_copies_the_first_childs_error_file_into_the_parents(tmp_path, monkeypatch):
    ours_file = tmp_path / "parent" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(ours_file))
    child = _error_file(tmp_path / "child.json", "ZeroDivisionError: in the child")

    @errors.record
    def parent():
        raise errors.ChildFailedError("trainer", {7: errors.ProcessFailure(0, 99, 1, child)})

    with pytest.raises(errors.ChildFailedError):
        parent()
    assert json.loads(ours_file.read_text()) == json.loads(open(child).read())


def test_record_writes_an_exception_and_treats_exit_codes_as_torch(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @errors.record
    def clean_exit():
        raise SystemExit(0)

    assert clean_exit() is None and not path.exists()  # exit(0) is success, as in torch

    @errors.record
    def exit_code():
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        exit_code()
    assert not path.exists()  # the script's own exit code is its report

    @errors.record
    def raises():
        raise KeyError("recorded")

    with pytest.raises(KeyError):
        raises()
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "KeyError: 'recorded'"
    assert "raise KeyError" in data["message"]["extraInfo"]["py_callstack"]


def test_record_uses_torchs_error_handler_protocol_when_given_one(tmp_path):
    calls = []

    class Handler:
        def initialize(self):
            calls.append("initialize")

        def record_exception(self, e):
            calls.append(("record", type(e).__name__))

        def dump_error_file(self, path, exitcode):
            calls.append(("dump", os.path.basename(path), exitcode))

    child = _error_file(tmp_path / "child.json")

    def fail():
        raise errors.ChildFailedError("t", {0: errors.ProcessFailure(0, 1, 2, child)})

    for fn in (fail, lambda: 1 / 0):
        with pytest.raises((errors.ChildFailedError, ZeroDivisionError)):
            errors.record(fn, error_handler=Handler())()
    assert calls == ["initialize", ("dump", "child.json", 2), "initialize", ("record", "ZeroDivisionError")]
