"""Tensor parallelism (`--tensor-parallel-size`): Megatron-style shards of the decoder on one
process per rank, rank 0 being the engine (`runner`), the others workers (`worker`) that run each
step rank 0 broadcasts (`step_broadcast`), over a torch.distributed group (`group`)."""
