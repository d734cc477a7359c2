"""plait.comm.device: no streams and no calls on CPU; the recording backend logs the order of
record / wait calls the strategies' tests check; group_device puts control-plane tensors where
the group's backend takes them."""

import torch

from plait import comm
from plait.comm import device
from plait.testing import distributed
from plait.testing.streams import RecordingStreams


class _Refuses:
    """A backend that fails on any stream call: proves the None path makes none."""

    def has_streams(self, dev):
        return dev.type != "cpu"

    def __getattr__(self, name):
        raise AssertionError(f"stream call {name} on CPU")


def test_cpu_has_no_streams_and_every_call_is_a_no_op():
    cpu = torch.device("cpu")
    with device.use_backend(_Refuses()):
        assert device.side_stream(cpu, "fsdp.all_gather") is None
        assert device.current_stream(cpu) is None
        assert device.record_event(None) is None
        device.wait_event(None, None)
        device.wait_stream(None, None)
        ctx = device.stream_context(None)
        assert ctx is device.stream_context(None)  # one shared null context: nothing allocated
        with ctx:
            pass
    assert device.side_stream(torch.device("meta"), "x") is None  # the real backend: no meta streams


def test_side_streams_are_created_once_per_device_and_name():
    with device.use_backend(RecordingStreams()):
        cpu = torch.device("cpu")
        a = device.side_stream(cpu, "fsdp.all_gather")
        assert device.side_stream(cpu, "fsdp.all_gather") is a
        assert device.side_stream(cpu, "fsdp.reduce_scatter") is not a
    assert device.side_stream(torch.device("cpu"), "fsdp.all_gather") is None  # restored on exit


def test_recording_backend_logs_the_promised_order():
    rec = RecordingStreams()
    with device.use_backend(rec):
        cpu = torch.device("cpu")
        s1, s2 = device.side_stream(cpu, "a.s1"), device.side_stream(cpu, "a.s2")
        device.wait_stream(s1, device.current_stream(cpu))
        with device.stream_context(s1):
            assert device.current_stream(cpu) is s1
            e = device.record_event(s1)
        assert device.current_stream(cpu) is rec.default
        device.wait_event(s2, e)
        device.wait_stream(s1, s1)  # a stream never waits on itself
    assert rec.log == ["s1.wait_stream(default)", "enter s1", "s1.record(e1)", "exit s1", "s2.wait(e1)"]


@distributed([2])
def test_group_device_is_where_the_backend_takes_tensors():
    g = comm.world_group()
    assert device.group_device(g) == torch.device("cpu")  # Gloo
    t = torch.ones(1, device=device.group_device(g))
    comm.all_reduce(t, group=g)
    assert t.item() == 2.0
