"""kvtransport driver for same-host GPU to GPU copies over CUDA IPC (cuda-local)."""
