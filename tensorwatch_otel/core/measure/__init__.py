"""Measuring tensors: abs min/max, non-finite kinds and magnitude counts, by the C kernel on the
CPU, the Triton kernels and their slot buffer on a device, torch ops for odd tensors, and the
in-graph statistics of compiled graphs; the weight table that reads each weight once per step."""
