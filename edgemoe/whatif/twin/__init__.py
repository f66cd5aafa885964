"""A twin of the streaming pipeline: decode and prefill speed as on a named machine.

    profiles   machine profiles as data, every figure with its source; this machine measured
    shapes     named model shapes, their expert records on disk, routing traces mapped onto them
    engine     the run: the real ExpertStore, readers, slots and policy over real-size
               records; the model's compute replaced by timed waits from the profile
    compute    the model's compute per piece of a forward call, and the waits for it
    readers    the readers (as macOS reads, or this machine's, CPU counted), scratch slots

Reads and compute keep the profile's ratio: every wait is stretched by this disk's time
per record over the profile's SSD's, and the forecast is the twin's time over that stretch.
Driven by scripts/bench_twin.py. What it gives is a forecast, not a measurement, until
`bench_twin.py --validate` has compared it with real runs on this machine.
"""
