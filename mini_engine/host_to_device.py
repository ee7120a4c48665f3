"""Small host arrays to the device without waiting for it."""
import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy from pinned memory, queued on the current stream: a copy from pageable memory would
    wait for every kernel queued before it (cudaMemcpyAsync stages pageable memory synchronously),
    and so stop the host until the device caught up."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
