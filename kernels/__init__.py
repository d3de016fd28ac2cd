"""Compute kernels: torch reference ops (the ground truth every other kernel is tested against),
CPU fast paths and Triton kernels for the GPU."""
