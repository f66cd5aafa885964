"""The device operations the slot memory orders: copies, events, waits.

Behind this small interface so that the ordering rules (edgemoe.cuda.slots) run
unchanged on a GPU (CudaStreams), on the CPU with synchronous copies (HostStreams), and
in tests on a fake device that records and checks every operation.
"""

import torch


class CudaStreams:
    """Copies on `lanes` dedicated streams; compute on the stream current when this was
    made. A copy names its lane (the slot memory keeps each slot on one)."""

    pinned = True  # host rows are page-locked, so copies from them are asynchronous

    def __init__(self, device="cuda", lanes: int = 1):
        self.device = torch.device(device)
        self.copy_streams = [torch.cuda.Stream(self.device) for _ in range(lanes)]
        self.compute_stream = torch.cuda.current_stream(self.device)

    @property
    def lanes(self) -> int:
        return len(self.copy_streams)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, lane: int = 0):
        with torch.cuda.stream(self.copy_streams[lane]):
            dst.copy_(src, non_blocking=True)

    def record_copy(self, lane: int = 0):
        return self.copy_streams[lane].record_event()

    def record_compute(self):
        return self.compute_stream.record_event()

    def copy_wait(self, event, lane: int = 0):
        self.copy_streams[lane].wait_event(event)

    def compute_wait(self, event):
        self.compute_stream.wait_event(event)

    def host_wait(self, event):
        event.synchronize()


class HostStreams:
    """The CPU: copies are done when `copy` returns, so there is nothing to order."""

    pinned = False
    lanes = 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor, lane: int = 0):
        dst.copy_(src)

    def record_copy(self, lane: int = 0):
        return None

    def record_compute(self):
        return None

    def copy_wait(self, event, lane: int = 0):
        pass

    def compute_wait(self, event):
        pass

    def host_wait(self, event):
        pass


def make_streams(device, lanes: int = 1) -> object:
    """`lanes` copy streams on a GPU; synchronous copies on the CPU."""
    if torch.device(device).type == "cuda":
        return CudaStreams(device, lanes)
    return HostStreams()
