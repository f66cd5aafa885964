"""The device operations the slot memory orders: copies, events, waits.

Behind this small interface so that the ordering rules (edgemoe.cuda.slots) run
unchanged on a GPU (CudaStreams), on the CPU with synchronous copies (HostStreams), and
in tests on a fake device that records and checks every operation.
"""

import torch


class CudaStreams:
    """Copies on a dedicated stream; compute on the stream current when this was made."""

    pinned = True  # host rows are page-locked, so copies from them are asynchronous

    def __init__(self, device="cuda"):
        self.device = torch.device(device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.current_stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)

    def record_copy(self):
        return self.copy_stream.record_event()

    def record_compute(self):
        return self.compute_stream.record_event()

    def copy_wait(self, event):
        self.copy_stream.wait_event(event)

    def compute_wait(self, event):
        self.compute_stream.wait_event(event)

    def host_wait(self, event):
        event.synchronize()


class HostStreams:
    """The CPU: copies are done when `copy` returns, so there is nothing to order."""

    pinned = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        dst.copy_(src)

    def record_copy(self):
        return None

    def record_compute(self):
        return None

    def copy_wait(self, event):
        pass

    def compute_wait(self, event):
        pass

    def host_wait(self, event):
        pass


def make_streams(device) -> object:
    return CudaStreams(device) if torch.device(device).type == "cuda" else HostStreams()
