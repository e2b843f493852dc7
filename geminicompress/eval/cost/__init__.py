"""Cost: latency and throughput, machine contention, footprint (memory, disk, parameters), the pre-load plan."""
